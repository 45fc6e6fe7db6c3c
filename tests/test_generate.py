"""generate / Sampling / TextGeneration: greedy parity, per-row keys, ragged rows, EOS, log-probs."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.inference import TextGeneration
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.sampling import Generation, Sampling, generate
from dew.sampling import text as text_module
from dew.sampling.text import process_logits

VOCAB = 61
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 12], [30]]
KEY = jax.random.key(7)


@pytest.fixture(scope="module")
def lm():
    model = CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              mlp_features=64, max_seq_len=32, attention_impl="xla",
                              layer_types=("sliding_attention", "full_attention"),
                              kinds={"sliding_attention": LayerKind(window=3)})
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32)))
    return model, variables


@pytest.fixture(scope="module")
def forward(lm):
    """Full-sequence logits of a row, padded to 16 tokens so one compile serves every length."""
    model, variables = lm
    apply = jax.jit(model.apply)

    def logits_at_end(row):
        padded = np.zeros((1, 16), np.int32)
        padded[0, : len(row)] = row
        return np.asarray(apply(variables, padded))[0, len(row) - 1]

    return logits_at_end


def test_greedy_equals_argmax_of_repeated_full_forward_passes(lm, forward):
    model, variables = lm
    result = generate(model, variables, PROMPTS, 6, key=KEY, sampling=Sampling(temperature=0.0))
    assert isinstance(result, Generation)
    assert result.tokens.shape == (3, 6) and result.tokens.dtype == jnp.int32
    for row, prompt in enumerate(PROMPTS):
        sequence = list(prompt)
        for t in range(6):
            logits = forward(sequence)
            assert int(result.tokens[row, t]) == int(np.argmax(logits))
            raw = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            np.testing.assert_allclose(float(result.raw_log_probs[row, t]), raw[int(np.argmax(logits))], atol=1e-4)
            sequence.append(int(np.argmax(logits)))
    np.testing.assert_array_equal(np.asarray(result.lengths), [6, 6, 6])
    assert not np.asarray(result.terminated).any()
    np.testing.assert_array_equal(np.asarray(result.behavior_log_probs), 0.0)  # greedy is a point mass


def test_one_continuation_equals_continuation_zero_of_four(lm):
    model, variables = lm
    one = generate(model, variables, PROMPTS, 6, key=KEY, n=1).host()
    four = generate(model, variables, PROMPTS, 6, key=KEY, n=4).host()
    assert four.tokens.shape == (12, 6)
    np.testing.assert_array_equal(four.tokens[::4], one.tokens)
    np.testing.assert_allclose(four.raw_log_probs[::4], one.raw_log_probs, atol=1e-5)
    # the four continuations of a prompt are different draws
    assert len({tuple(r) for r in four.tokens[:4]}) > 1


def test_a_ragged_batch_row_equals_that_row_generated_alone(lm):
    model, variables = lm
    greedy = Sampling(temperature=0.0)
    batch = generate(model, variables, PROMPTS, 6, key=KEY, sampling=greedy).host()
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, variables, [prompt], 6, key=KEY, sampling=greedy).host()
        np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])
        np.testing.assert_allclose(batch.raw_log_probs[row], alone.raw_log_probs[0], atol=1e-5)
    # sampled, prompt 0 keeps its key (fold_in(key, 0)) alone or in a batch padded to a longer bucket
    longer = [PROMPTS[0], list(range(1, 12))]
    sampled = generate(model, variables, longer, 6, key=KEY).host()
    alone = generate(model, variables, [PROMPTS[0]], 6, key=KEY).host()
    np.testing.assert_array_equal(sampled.tokens[0], alone.tokens[0])


def test_eos_stops_a_row_and_pads_after_it(lm):
    model, variables = lm
    free = generate(model, variables, PROMPTS, 6, key=KEY, sampling=Sampling(temperature=0.0)).host()
    eos = int(free.tokens[0, 2])
    stopped = generate(model, variables, PROMPTS, 6, key=KEY,
                       sampling=Sampling(temperature=0.0, eos_token_ids=[eos], pad_id=-1)).host()
    first = int(np.flatnonzero(free.tokens[0] == eos)[0])
    assert stopped.terminated[0] and stopped.lengths[0] == first + 1
    np.testing.assert_array_equal(stopped.tokens[0, : first + 1], free.tokens[0, : first + 1])
    np.testing.assert_array_equal(stopped.tokens[0, first + 1:], -1)
    np.testing.assert_array_equal(stopped.raw_log_probs[0, first + 1:], 0.0)
    for row in range(1, 3):  # rows that never draw the EOS token run to max_new_tokens
        if eos not in free.tokens[row]:
            assert not stopped.terminated[row] and stopped.lengths[row] == 6
            np.testing.assert_array_equal(stopped.tokens[row], free.tokens[row])


def test_top_k_1_equals_greedy(lm):
    model, variables = lm
    greedy = generate(model, variables, PROMPTS, 6, key=KEY, sampling=Sampling(temperature=0.0)).host()
    top1 = generate(model, variables, PROMPTS, 6, key=KEY, sampling=Sampling(temperature=0.7, top_k=1)).host()
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_allclose(top1.behavior_log_probs, 0.0, atol=1e-6)  # one token left: probability 1


def test_behavior_and_raw_log_probs(lm, forward):
    model, variables = lm
    plain = generate(model, variables, PROMPTS, 6, key=KEY).host()  # temperature 1, no filters
    np.testing.assert_allclose(plain.behavior_log_probs, plain.raw_log_probs, atol=1e-5)

    hot = generate(model, variables, PROMPTS, 6, key=KEY, sampling=Sampling(temperature=0.5)).host()
    logits = forward(PROMPTS[1])
    token = int(hot.tokens[1, 0])
    scaled = logits / 0.5
    want = scaled[token] - scaled.max() - np.log(np.sum(np.exp(scaled - scaled.max())))
    np.testing.assert_allclose(hot.behavior_log_probs[1, 0], want, atol=1e-4)
    assert abs(hot.behavior_log_probs[1, 0] - hot.raw_log_probs[1, 0]) > 1e-3

    truncated = generate(model, variables, PROMPTS, 6, key=KEY,
                         sampling=Sampling(top_k=5, top_p=0.9, min_p=0.05)).host()
    # renormalizing over fewer tokens can only raise a kept token's probability
    assert (truncated.behavior_log_probs >= truncated.raw_log_probs - 1e-5).all()
    assert (truncated.behavior_log_probs > truncated.raw_log_probs + 1e-3).any()


def test_filters_keep_the_tokens_they_promise():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    kept = lambda s: np.isfinite(np.asarray(process_logits(logits, s)))[0].tolist()  # noqa: E731
    assert kept(Sampling(top_k=2)) == [True, True, False, False]
    assert kept(Sampling(top_p=0.7)) == [True, True, False, False]  # 0.4 + 0.3 reaches 0.7
    assert kept(Sampling(top_p=0.71)) == [True, True, True, False]
    assert kept(Sampling(top_p=0.3)) == [True, False, False, False]
    assert kept(Sampling(min_p=0.4)) == [True, True, True, False]  # 0.1 < 0.4 * 0.4 <= 0.2
    scaled = np.asarray(process_logits(logits, Sampling(temperature=2.0)))
    np.testing.assert_allclose(scaled, np.asarray(logits) / 2, rtol=1e-6)


def test_new_prompts_of_the_same_shape_do_not_recompile(lm):
    model, variables = lm
    before = text_module._generate_jit._cache_size()
    first = generate(model, variables, [[1, 2, 3], [4, 5]], 6, key=KEY, sampling=Sampling(temperature=0.9))
    assert text_module._generate_jit._cache_size() == before + 1  # the counter does count a compile
    again = generate(model, variables, [[9, 8, 7, 6], [3]], 6, key=jax.random.key(99),
                     sampling=Sampling(temperature=0.9))
    assert text_module._generate_jit._cache_size() == before + 1
    assert again.tokens.shape == first.tokens.shape == (2, 6)


def test_sampling_settings_are_normalized_and_validated():
    assert Sampling(eos_token_ids=3).eos_token_ids == (3,)
    assert Sampling(eos_token_ids=[3, 4]).eos_token_ids == (3, 4)
    assert Sampling(eos_token_ids=None).eos_token_ids == ()
    assert Sampling(temperature=0).greedy
    for bad in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0)):
        with pytest.raises(ValueError):
            Sampling(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Sampling().temperature = 2.0


def test_bad_generate_inputs_raise_clear_errors(lm):
    model, variables = lm
    with pytest.raises(ValueError, match="max_seq_len=32"):
        generate(model, variables, [list(range(1, 30))], 4, key=KEY)
    with pytest.raises(ValueError, match=f"prompt 1: token id {VOCAB}"):
        generate(model, variables, [[1, 2], [3, VOCAB]], 4, key=KEY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, variables, np.array([[1, -2]]), 4, key=KEY)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, variables, [[1], []], 4, key=KEY)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(model, variables, [], 4, key=KEY)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, variables, [[1]], 0, key=KEY)
    with pytest.raises(ValueError, match="n must be"):
        generate(model, variables, [[1]], 4, key=KEY, n=0)
    with pytest.raises(TypeError, match="token ids, not text"):
        generate(model, variables, "hello", 4, key=KEY)


class _Digits:
    """A toy tokenizer: characters '0'..'9' and ids 0..9 map onto each other."""

    def encode(self, text):
        return [int(c) for c in text]

    def decode(self, ids):
        return "".join(str(i % 10) for i in ids)


def test_text_generation_task(lm):
    model, variables = lm
    task = TextGeneration(model, variables, sampling=Sampling(temperature=0.0), processor=_Digits())
    by_seed = task([[5, 9, 2]], 6, seed=3)
    by_key = task([[5, 9, 2]], 6, key=jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(by_seed.tokens), np.asarray(by_key.tokens))
    direct = generate(model, variables, [[5, 9, 2]], 6, key=KEY, sampling=Sampling(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(by_key.tokens), np.asarray(direct.tokens))
    np.testing.assert_array_equal(np.asarray(task("592", 6, seed=0).tokens), np.asarray(direct.tokens))
    assert task.decode(by_key) == [_Digits().decode(np.asarray(by_key.tokens[0]).tolist())]

    sampled = task(PROMPTS, 6, seed=0, sampling=Sampling(), n=4)
    assert sampled.tokens.shape == (12, 6)

    other = jax.tree_util.tree_map(lambda x: x * 3.0, variables)
    bound = task.bind(other)
    assert bound is not task and bound.variables is other and task.variables is variables
    assert bound.sampling == task.sampling
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.variables = other
    with pytest.raises(ValueError, match="exactly one of seed= .* or key="):
        task([[1]], 2)
    with pytest.raises(ValueError, match="exactly one"):
        task([[1]], 2, key=KEY, seed=1)
    with pytest.raises(ValueError, match="no processor"):
        TextGeneration(model, variables).decode(by_key)


def test_row_keys_fold_the_prompt_index_then_the_continuation_index():
    keys = text_module._row_keys(KEY, 2, 3)
    want = jax.random.fold_in(jax.random.fold_in(KEY, 1), 2)
    np.testing.assert_array_equal(jax.random.key_data(keys[1 * 3 + 2]), jax.random.key_data(want))
    assert not np.array_equal(jax.random.key_data(keys[2]), jax.random.key_data(want))


def test_a_scanned_decoder_generates_what_the_unscanned_one_does(lm):
    model, variables = lm
    params = variables["params"]
    stacked = {k: v for k, v in params.items() if not k.startswith("layers_")}
    stacked["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), params["layers_0"], params["layers_1"])
    greedy = Sampling(temperature=0.0)
    want = generate(model, variables, PROMPTS, 6, key=KEY, sampling=greedy).host()
    got = generate(model.clone(scan_layers=True), {"params": stacked}, PROMPTS, 6, key=KEY, sampling=greedy,
                   n=2).host()
    np.testing.assert_array_equal(got.tokens[::2], want.tokens)
    np.testing.assert_array_equal(got.tokens[1::2], want.tokens)


def test_a_prompt_padded_near_max_seq_len_keeps_every_drawn_token_in_the_cache(lm):
    """A 17-token prompt pads to 32 = max_seq_len; its 10 draws still need their own cache slots."""
    model, variables = lm
    prompt = [(7 * i) % VOCAB for i in range(17)]
    result = generate(model, variables, [prompt], 10, key=KEY, sampling=Sampling(temperature=0.0)).host()
    apply = jax.jit(model.apply)
    sequence = list(prompt)
    for t in range(10):
        padded = np.zeros((1, 32), np.int32)
        padded[0, : len(sequence)] = sequence
        logits = np.asarray(apply(variables, padded))[0, len(sequence) - 1]
        assert int(result.tokens[0, t]) == int(np.argmax(logits)), f"draw {t}"
        np.testing.assert_allclose(float(result.raw_log_probs[0, t]),
                                   float(jax.nn.log_softmax(logits)[int(np.argmax(logits))]), atol=1e-4)
        sequence.append(int(np.argmax(logits)))
