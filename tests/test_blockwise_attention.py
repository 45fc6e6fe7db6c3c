"""The "blockwise" attention kernel: the reference kernel's values and gradients for every mask rule,
without a [queries, keys] score matrix in the compiled forward or backward pass; "auto" takes it for
long keys off a GPU only; the sequence-parallel paths run it."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import MeshSpec
from dew.nn import attention, sequence_parallel
from dew.nn.attention import (
    BLOCKWISE_MIN_KEYS,
    ROWWISE_MIN_KEYS,
    blockwise_attention,
    dot_product_attention,
    resolve_attention_impl,
)
from dew.nn.sequence_parallel import SequenceSplit, splitting
from dew.training import mesh as mesh_lib

# 37 queries and keys in blocks of 8: five blocks each, the last padded; 4 query heads over 2 kv heads
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 37, 4, 2, 8, 8
SEGMENTS = np.repeat(np.stack([[0, 1, 2], [0, 1, 1]]), [10, 15, 12], axis=1).astype(np.int32)
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def tensors(seed=0, q_len=LENGTH, kv_len=LENGTH):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (BATCH, q_len, HEADS, HEAD_DIM)),
            jax.random.normal(keys[1], (BATCH, kv_len, KV_HEADS, HEAD_DIM)),
            jax.random.normal(keys[2], (BATCH, kv_len, KV_HEADS, HEAD_DIM)),
            jax.random.normal(keys[3], (BATCH, q_len, HEADS, HEAD_DIM)))


def blockwise(q, k, v, *, causal=True, window=None, segment_ids=None, kv_lengths=None, mask=None, sinks=None,
              q_positions=None):
    """`blockwise_attention` with blocks of BLOCK, positions and rules spelled as dot_product_attention's."""
    kv_positions = jnp.arange(k.shape[1])
    q_positions = kv_positions[k.shape[1] - q.shape[1]:] if q_positions is None else q_positions
    return blockwise_attention(
        q, k, v, q_positions=q_positions, kv_positions=kv_positions, causal=causal, window=window,
        q_segment_ids=segment_ids, kv_segment_ids=segment_ids, kv_lengths=kv_lengths, mask=mask,
        scale=HEAD_DIM ** -0.5, sinks=sinks, block=BLOCK,
    )


def values_and_gradients(attention, q, k, v, cotangent, sinks, **rules):
    """The output and the gradients of <output, cotangent> in q, k, v (and the sinks, when given)."""
    def loss(q, k, v, sinks):
        return jnp.sum(attention(q, k, v, sinks=sinks, **rules) * cotangent)

    @jax.jit
    def run(q, k, v, sinks):
        grads = jax.grad(loss, argnums=(0, 1, 2) if sinks is None else (0, 1, 2, 3))(q, k, v, sinks)
        return (attention(q, k, v, sinks=sinks, **rules), *grads)

    return run(q, k, v, sinks)


def reference(q, k, v, **rules):
    return dot_product_attention(q, k, v, impl="reference", **rules)


RULES = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "window": dict(causal=True, window=5),
    "traced-window": dict(causal=True, window=jnp.asarray(5)),
    "segments": dict(causal=True, segment_ids=SEGMENTS),
    "window+segments": dict(causal=True, window=4, segment_ids=SEGMENTS),
    "lengths": dict(causal=False, kv_lengths=jnp.asarray([20, 37])),
    "key-mask": dict(causal=False, mask=jnp.asarray(np.arange(LENGTH) % 3 != 1)[None, None, None, :]),
}


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("rules", list(RULES.values()), ids=list(RULES))
def test_blockwise_gives_the_reference_values_and_gradients(rules, sinks):
    q, k, v, cotangent = tensors()
    sinks = None if sinks is None else jnp.asarray(sinks)
    got = values_and_gradients(blockwise, q, k, v, cotangent, sinks, **rules)
    want = values_and_gradients(reference, q, k, v, cotangent, sinks, **rules)
    for name, g, w in zip(("output", "dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=name)


# how an unmasked call runs 80 query rows (2 query heads x 40, the queries padded to whole blocks
# of 8) against 40 keys: all rows in one block; blocks of 64 rows, the last one padded; key blocks
# with the online softmax, as off a CPU and when a block would hold fewer than 64 rows. Each with the
# shape of its forward pass's scores, and of the scores its backward pass holds keys by rows
FORWARDS = {
    "rows": ({}, "<80x40xf32>", "<40x80xf32>"),
    "padded-rows": ({"ROWWISE_SCORES": 64 * 40}, "<64x40xf32>", "<40x64xf32>"),
    "key-blocks-gpu": ({"_on_cpu": lambda: False}, "<2x2x2x8x8xf32>", "<2x2x2x8x8xf32>"),
    "key-blocks-long": ({"ROWWISE_SCORES": 63 * 40}, "<2x2x2x8x8xf32>", "<2x2x2x8x8xf32>"),
}


@pytest.mark.parametrize("forward", list(FORWARDS))
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
def test_unmasked_blockwise_builds_no_mask_and_gives_the_reference(sinks, forward, monkeypatch):
    """Bidirectional, no rule, whole blocks of keys (40 = 5 x 8): the path that scores without a mask,
    both passes by rows of all keys (on a CPU, while a block holds 64 rows) or by key blocks."""
    settings, scores, transposed = FORWARDS[forward]
    for name, value in settings.items():
        monkeypatch.setattr(attention, name, value)
    q, k, v, cotangent = tensors(seed=2, q_len=37, kv_len=40)
    sinks = None if sinks is None else jnp.asarray(sinks)
    got = values_and_gradients(blockwise, q, k, v, cotangent, sinks, causal=False)
    want = values_and_gradients(reference, q, k, v, cotangent, sinks, causal=False)
    for name, g, w in zip(("output", "dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=name)
    text = jax.jit(lambda q, k, v: blockwise(q, k, v, causal=False)).lower(q, k, v).as_text()
    assert "select" not in text  # no jnp.where over any block's scores
    if forward.endswith("rows"):  # key blocks of 8 share their shape with the rescaled running output
        # the queries come scaled, so no multiply runs over the scores (XLA:CPU's products run faster bare)
        assert not [line for line in text.splitlines() if "stablehlo.multiply" in line and scores in line]
    # the forward pass's scores come in blocks of this shape; the other paths' never do
    assert [other for other, (_, shape, _) in FORWARDS.items() if shape in text] == [
        other for other, (_, shape, _) in FORWARDS.items() if shape == scores]
    # and the backward pass's: the rows paths hold a block's scores with the keys along the rows too
    grad_text = jax.jit(jax.grad(lambda q, k, v: blockwise(q, k, v, causal=False).sum(), argnums=(0, 1, 2))).lower(
        q, k, v).as_text()
    assert [other for other, (_, _, shape) in FORWARDS.items() if shape in grad_text] == [
        other for other, (_, _, shape) in FORWARDS.items() if shape == transposed]
    # negative control: a causal call over the same whole blocks builds its mask
    assert "select" in jax.jit(lambda q, k, v: blockwise(q, k, v)).lower(q, k, v).as_text()


def test_rows_path_offsets_a_block_by_a_bound_close_to_its_maxima_else_by_the_maxima(monkeypatch):
    """The rows path's softmax subtracts ``|q| max |k|`` from a block's scores when that bound lies
    within ROWWISE_BOUND_GAP of a score of every row (ordinary logits), else each row's maximum
    (logits of hundreds), and either way gives the reference's values and gradients."""
    scores = jnp.asarray([[1.0, 3.0, -2.0], [0.5, 0.0, 2.5]])
    near, far = jnp.asarray([10.0, 4.0]), jnp.asarray([10.0, 4.0 + attention.ROWWISE_BOUND_GAP])
    np.testing.assert_array_equal(attention._softmax_offsets(scores, near), near)
    np.testing.assert_array_equal(attention._softmax_offsets(scores, far), [3.0, 2.5])  # one row past the gap
    q, k, v, cotangent = tensors(seed=2, q_len=37, kv_len=40)
    large = dict(q=q * 12, k=k * 12)  # logits of hundreds: their bound lies far above their maxima
    for inputs in (dict(q=q, k=k), large):
        args = (inputs["q"], inputs["k"], v, cotangent, None)
        got = values_and_gradients(blockwise, *args, causal=False)
        want = values_and_gradients(reference, *args, causal=False)
        for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(g, w, atol=2e-5 * (1 + np.abs(w).max()), rtol=1e-5, err_msg=name)
    # negative control: the bound taken at any distance leaves the large logits' weights below
    # float32's range
    monkeypatch.setattr(attention, "ROWWISE_BOUND_GAP", np.inf)
    wrong = blockwise(large["q"], large["k"], v, causal=False)
    assert not np.isfinite(wrong).all() or np.abs(wrong - want[0]).max() > 1e-2


def test_blockwise_is_checked_against_rules_that_matter():
    """Negative controls: the comparison above fails when a rule is dropped, or a block misplaced."""
    q, k, v, cotangent = tensors()
    want = reference(q, k, v, causal=True, window=4, segment_ids=SEGMENTS, sinks=jnp.asarray(SINKS))
    for wrong in (dict(causal=True, segment_ids=SEGMENTS, sinks=jnp.asarray(SINKS)),  # no window
                  dict(causal=True, window=4, sinks=jnp.asarray(SINKS)),  # no segments
                  dict(causal=True, window=4, segment_ids=SEGMENTS)):  # no sinks
        assert np.abs(blockwise(q, k, v, **wrong) - want).max() > 1e-2
    shifted = blockwise(q, k, v, causal=True, window=4, segment_ids=SEGMENTS, sinks=jnp.asarray(SINKS),
                        q_positions=jnp.arange(LENGTH) + 1)  # each query one position late
    assert np.abs(shifted - want).max() > 1e-2


def test_blockwise_takes_fewer_queries_than_keys_and_a_per_head_mask():
    q, k, v, cotangent = tensors(seed=1, q_len=11, kv_len=LENGTH)  # queries at the last 11 positions
    per_head = jax.random.bernoulli(jax.random.key(5), 0.7, (BATCH, HEADS, 11, LENGTH)).at[..., 0].set(True)
    for rules in (dict(causal=True, window=6), dict(causal=False, mask=per_head)):
        got = values_and_gradients(blockwise, q, k, v, cotangent, None, **rules)
        want = values_and_gradients(reference, q, k, v, cotangent, None, **rules)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)
    swapped = per_head[:, ::-1]  # negative control: the heads' masks reversed
    assert np.abs(blockwise(q, k, v, causal=False, mask=swapped) - want[0]).max() > 1e-2


def test_blockwise_through_dot_product_attention_in_bfloat16():
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in tensors(seed=2))
    got = dot_product_attention(q, k, v, causal=True, segment_ids=SEGMENTS, impl="blockwise")
    assert got.dtype == jnp.bfloat16
    want = dot_product_attention(q, k, v, causal=True, segment_ids=SEGMENTS, impl="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def scratch_bytes(impl, length):
    """XLA's temporary bytes for the gradient of one call at `length` queries and keys (compiled only)."""
    q = jax.ShapeDtypeStruct((1, length, HEADS, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, KV_HEADS, 64), jnp.float32)
    loss = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, causal=True, impl=impl))  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_backward_never_holds_the_scores():
    length = 8192
    scores = HEADS * length * length * 4  # one float32 [queries, keys] matrix per head: 1 GiB
    assert scratch_bytes("blockwise", length) < scores / 16  # a few blocks' scores: 4 MiB each
    # negative control: the one-shot kernel's gradient holds at least the scores
    assert scratch_bytes("xla", length) > scores


def test_auto_takes_blockwise_for_long_keys_off_a_gpu():
    cpu, gpu = SimpleNamespace(platform="cpu"), SimpleNamespace(platform="gpu", compute_capability="9.0")
    tpu = SimpleNamespace(platform="tpu")
    long, short = BLOCKWISE_MIN_KEYS, BLOCKWISE_MIN_KEYS - 1
    assert resolve_attention_impl("auto", kv_len=long, device=cpu) == "blockwise"
    assert resolve_attention_impl("auto", kv_len=long, device=tpu) == "blockwise"
    assert resolve_attention_impl("auto", kv_len=short, device=cpu) == "xla"
    assert resolve_attention_impl("auto", kv_len=long, device=gpu) == "xla"  # float32: XLA's GPU kernel
    assert resolve_attention_impl("auto", kv_len=long, dtype=jnp.bfloat16, head_dim=64, device=gpu) == "cudnn"
    assert resolve_attention_impl("auto", kv_len=long, dtype=jnp.float64, device=cpu) == "reference"
    assert resolve_attention_impl("blockwise", kv_len=8, device=gpu) == "blockwise"
    # on a CPU, a call its rows path takes runs it from fewer keys
    assert resolve_attention_impl("auto", kv_len=ROWWISE_MIN_KEYS, rows_ok=True, device=cpu) == "blockwise"
    assert resolve_attention_impl("auto", kv_len=ROWWISE_MIN_KEYS - 1, rows_ok=True, device=cpu) == "xla"
    assert resolve_attention_impl("auto", kv_len=ROWWISE_MIN_KEYS, device=cpu) == "xla"
    assert resolve_attention_impl("auto", kv_len=ROWWISE_MIN_KEYS, rows_ok=True, device=tpu) == "xla"


def test_auto_takes_the_rows_path_for_an_unmasked_call_over_whole_blocks_of_keys(monkeypatch):
    """From ROWWISE_MIN_KEYS keys on this CPU: bidirectional calls with nothing to mask, whose keys
    fill whole blocks (256 for heads of 8), run "blockwise"; a causal call, a masked one and one
    whose last key block would need padding keep the one-shot kernel."""
    calls = []
    monkeypatch.setattr(attention, "blockwise_attention", lambda *a, **kw: calls.append(kw) or a[0])
    keys = jax.random.normal(jax.random.key(0), (1, ROWWISE_MIN_KEYS + 256, 1, 8))
    whole, ragged = keys[:, :ROWWISE_MIN_KEYS], keys[:, :ROWWISE_MIN_KEYS + 100]
    dot_product_attention(whole, whole, whole, causal=False)
    assert len(calls) == 1 and not calls[0]["causal"]
    dot_product_attention(whole, whole, whole, causal=True)
    dot_product_attention(whole, whole, whole, causal=False, mask=jnp.ones((1, 1, 1, ROWWISE_MIN_KEYS), bool))
    dot_product_attention(ragged, ragged, ragged, causal=False)
    dot_product_attention(whole[:, :ROWWISE_MIN_KEYS // 2], whole[:, :ROWWISE_MIN_KEYS // 2],
                          whole[:, :ROWWISE_MIN_KEYS // 2], causal=False)
    assert len(calls) == 1


@pytest.mark.parametrize("exchange", ["ulysses", "gather"])
def test_sequence_parallel_attention_runs_blockwise_on_both_paths(exchange, monkeypatch):
    """On 4 sequence devices each device's blockwise call (whole length for Ulysses, its queries at
    their global positions against all keys for the gather) gives plain attention's values and gradients."""
    monkeypatch.setattr(attention, "BLOCKWISE_BLOCK", BLOCK)  # several key blocks per device
    mesh = MeshSpec(sequence=4).build()  # data=2 x sequence=4
    q, k, v, cotangent = tensors(seed=3, q_len=32, kv_len=32)
    segments = jnp.asarray(np.where(np.arange(32) < [[13], [22]], 1, 2), jnp.int32)
    rules = dict(causal=True, window=6, segment_ids=segments, sinks=jnp.asarray(SINKS))

    def split(q, k, v):
        with splitting(SequenceSplit(mesh, mesh_lib.BATCH_AXES, exchange=exchange)):
            return sequence_parallel.attention(q, k, v, impl="blockwise", **rules)

    def plain(q, k, v):
        return dot_product_attention(q, k, v, impl="reference", **rules)

    assert "custom_vjp_call" in str(jax.make_jaxpr(split)(q, k, v))  # the blockwise kernel ran
    got = values_and_gradients(lambda q, k, v, sinks: split(q, k, v), q, k, v, cotangent, None)
    want = values_and_gradients(lambda q, k, v, sinks: plain(q, k, v), q, k, v, cotangent, None)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)
