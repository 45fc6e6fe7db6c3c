"""Guided generation: the vocabulary's bytes, JSON-schema grammars from outlines-core, and decoding
that keeps every draw inside the grammar."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import ByteTokenizer, HFTokenizer
from dew.nn.backbones import CausalTransformer
from dew.sampling import Sampling, generate
from dew.sampling.guided import guided_generate, json_schema, regex, token_bytes

pytest.importorskip("outlines_core")

TINY_TOOLS = Path(__file__).parent / "fixtures" / "tokenizers" / "tiny-tools"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
          "required": ["ok", "colour"]}
EOS = 0


def valid(text):
    """Whether `text` is a JSON document SCHEMA accepts."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(document, dict) and set(document) == {"ok", "colour"} and isinstance(document["ok"], bool)
            and document["colour"] in ("red", "green"))


@pytest.fixture(scope="module")
def decoder():
    tokenizer = HFTokenizer(TINY_TOOLS)
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=32, num_layers=1, num_heads=2,
                              mlp_features=64, max_seq_len=64, dtype=jnp.float32)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return tokenizer, model, variables


def test_token_bytes_reads_byte_level_tokens_and_leaves_special_tokens_out():
    tokenizer = HFTokenizer(TINY_TOOLS)
    pieces = token_bytes(tokenizer, tokenizer.vocab_size)
    ids = {i: data for data, group in pieces.items() for i in group}
    assert not {0, 1, 2} & set(ids)  # <|endoftext|>, <|im_start|>, <|im_end|>
    assert len(ids) == tokenizer.vocab_size - 3
    for i, data in ids.items():
        text = tokenizer.decode([i])
        if "\ufffd" not in text:  # a whole character: its bytes are its text's
            assert data == text.encode("utf-8"), i
    assert b"\xe2" in pieces  # a lone byte of a multi-byte character is a token too
    assert token_bytes(ByteTokenizer(), 256)[b"A"] == [65]


def test_guided_draws_parse_and_validate_where_unguided_ones_do_not(decoder):
    tokenizer, model, variables = decoder
    grammar = json_schema(tokenizer, SCHEMA, EOS)
    prompt = tokenizer.encode("Answer in JSON: ")
    for sampling in (Sampling(temperature=0.0, eos_token_ids=(EOS,)), Sampling(temperature=1.0, eos_token_ids=(EOS,))):
        for seed in range(2):
            tokens, logprobs, ended = guided_generate(model, variables, prompt, 40, grammar=grammar,
                                                      key=jax.random.key(seed), sampling=sampling)
            assert ended and tokens[-1] == EOS and len(logprobs) == len(tokens)
            assert valid(tokenizer.decode(tokens[:-1])), tokenizer.decode(tokens)
    free = generate(model, variables, [prompt], 40, key=jax.random.key(0), sampling=Sampling(temperature=1.0))
    assert not valid(tokenizer.decode(np.asarray(free.tokens[0]).tolist()))  # the control: unguided is not JSON


def test_a_regex_grammar_forces_its_text_and_a_schema_outlines_cannot_compile_raises(decoder):
    tokenizer, model, variables = decoder
    tokens, _, ended = guided_generate(model, variables, tokenizer.encode("x"), 20,
                                       grammar=regex(tokenizer, "(yes|no)!", EOS), key=jax.random.key(0),
                                       sampling=Sampling(temperature=1.0))
    assert ended and tokenizer.decode(tokens[:-1]) in ("yes!", "no!")
    with pytest.raises(ValueError, match="outlines-core"):
        json_schema(tokenizer, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, EOS)


# --- guided requests in the Server's batch --------------------------------------------------------


def _serve(server, plan, prompt, budget):
    """Submit (grammar, sampling, seed) requests one step apart, then step until all are done."""
    requests = []
    for grammar, sampling, seed in plan:
        requests.append(server.submit(prompt, max_new_tokens=budget, sampling=sampling, seed=seed, grammar=grammar))
        server.step()
    for _ in range(10 * budget):
        if all(r.finished or r.error is not None for r in requests):
            break
        server.step()
    return requests


def test_a_server_decodes_guided_requests_in_its_batch_each_drawing_what_it_draws_alone(decoder):
    from dew.inference import TextGeneration
    from dew.inference import serving
    from dew.inference.serving import Server

    tokenizer, model, variables = decoder
    task = TextGeneration(model, variables)
    schema, yes_no = json_schema(tokenizer, SCHEMA, EOS), regex(tokenizer, "(yes|no)!", EOS)
    greedy = Sampling(temperature=0.0, eos_token_ids=(EOS,))
    sampled = Sampling(temperature=1.0, eos_token_ids=(EOS,))
    plan = [(schema, greedy, 0), (None, sampled, 1), (schema, sampled, 2), (yes_no, sampled, 3), (None, greedy, 4)]
    prompt = tokenizer.encode("Answer in JSON: ")
    server = Server.from_task(task, slots=3, capacity=64, decode_steps=4)  # more requests than rows
    served = _serve(server, plan, prompt, 40)
    decodes = serving._decode_jit._cache_size()
    for request, (grammar, sampling, seed) in zip(served, plan):
        assert request.error is None and request.finished
        if grammar is None:
            alone = task([prompt], 40, seed=seed, sampling=sampling).host()
            want = alone.tokens[0, : int(alone.lengths[0])].tolist()
            assert request.tokens == want
            continue
        tokens, logprobs, ended = guided_generate(model, variables, prompt, 40, grammar=grammar,
                                                  key=jax.random.key(seed), sampling=sampling)
        assert request.tokens == tokens, f"guided request with seed {seed}"
        np.testing.assert_allclose([e.logprob for e in request.events], logprobs, atol=1e-4)
        assert ended and request.events[-1].finish_reason == "stop"
        text = tokenizer.decode(tokens[:-1])
        assert valid(text) if grammar is schema else text in ("yes!", "no!")
    # the control: the unguided request of the first's seed and settings writes no JSON
    unguided = _serve(server, [(None, sampled, 2)], prompt, 40)[0]
    assert not valid(tokenizer.decode([t for t in unguided.tokens if t != EOS]))
    # a second wave of the same mix compiles nothing new
    _serve(server, plan[::-1], prompt, 24)
    assert serving._decode_jit._cache_size() == decodes


class _GivesUp:
    """A grammar that allows every token but cannot go past its third."""

    def __init__(self, vocab_size):
        self.vocab_size, self.eos_id, self.initial = vocab_size, EOS, 0

    def mask(self, state):
        return np.ones(self.vocab_size, bool)

    def advance(self, state, token):
        if state == 2:
            raise ValueError("this grammar ends after three tokens")
        return state + 1


def test_a_grammar_that_cannot_go_on_ends_its_request_and_the_batch_goes_on(decoder):
    from dew.inference import TextGeneration
    from dew.inference.serving import Server

    tokenizer, model, variables = decoder
    task = TextGeneration(model, variables)
    server = Server.from_task(task, slots=2, capacity=64)
    sampling = Sampling(temperature=1.0)
    prompt = tokenizer.encode("x")
    failing, other = _serve(server, [(_GivesUp(model.vocab_size), sampling, 0), (None, sampling, 1)], prompt, 12)
    assert isinstance(failing.error, ValueError) and len(failing.events) == 2 and not failing.finished
    alone = task([prompt], 12, seed=1, sampling=sampling).host()
    assert other.finished and other.tokens == alone.tokens[0].tolist()
    assert server.stats()["running"] == 0.0
    with pytest.raises(ValueError, match="vocab_size=.*"):
        server.submit(prompt, max_new_tokens=4, sampling=sampling, seed=0, grammar=_GivesUp(model.vocab_size + 1))
    with pytest.raises(TypeError, match="Grammar"):
        server.submit(prompt, max_new_tokens=4, sampling=sampling, seed=0, grammar="(yes|no)")
