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
