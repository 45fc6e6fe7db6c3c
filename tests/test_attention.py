"""dot_product_attention: masks (causal, window, segments, lengths), GQA, and kernel choice."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.attention import (
    cache_attention,
    dot_product_attention,
    head_major_attention,
    reference_attention,
    resolve_attention_impl,
)


def _qkv(seed=0, batch=2, length=10, heads=4, kv_heads=2, head_dim=8, kv_length=None):
    rng = np.random.default_rng(seed)
    kv_length = length if kv_length is None else kv_length
    q = rng.normal(size=(batch, length, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, kv_length, kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, kv_length, kv_heads, head_dim)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _naive(q, k, v, allowed):
    """Per-query loop in float64: softmax over the keys allowed(b, i, j) says it may see."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for i in range(q_len):
            keys = [j for j in range(k.shape[1]) if allowed(b, i, j)]
            for h in range(heads):
                logits = np.array([q[b, i, h] @ k[b, j, h // groups] for j in keys]) / np.sqrt(head_dim)
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                out[b, i, h] = sum(w * v[b, j, h // groups] for w, j in zip(weights, keys))
    return out


SEGMENTS = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True),
        dict(causal=False),
        dict(causal=True, window=3),
        dict(causal=True, segment_ids=SEGMENTS),
        dict(causal=True, window=2, segment_ids=SEGMENTS),
        dict(causal=False, segment_ids=SEGMENTS),
    ],
    ids=["causal", "bidirectional", "window", "segments", "window+segments", "bidirectional+segments"],
)
def test_reference_and_xla_kernels_agree_with_gqa(options):
    q, k, v = _qkv()
    reference = dot_product_attention(q, k, v, impl="reference", **options)
    xla = dot_product_attention(q, k, v, impl="xla", **options)
    auto = dot_product_attention(q, k, v, impl="auto", **options)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(reference), atol=2e-5)
    np.testing.assert_allclose(np.asarray(auto), np.asarray(reference), atol=2e-5)


def test_cpu_head_major_kernel_matches_jax_attention_in_values_and_gradients():
    q, k, v = _qkv(length=6, kv_length=9)  # 4 query heads over 2 key/value heads
    rng = np.random.default_rng(3)
    mask = rng.random((2, 4, 6, 9)) < 0.6  # a different mask per head
    mask[..., 0] = True
    cotangent = jnp.asarray(rng.normal(size=q.shape).astype(np.float32))

    def loss(attention, m):
        return lambda q, k, v: jnp.sum(attention(q, k, v, jnp.asarray(m)) * cotangent)

    ours = lambda q, k, v, m: head_major_attention(q, k, v, m, scale=0.3)  # noqa: E731
    jax_nn = lambda q, k, v, m: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, mask=m, scale=0.3, implementation="xla")
    np.testing.assert_allclose(ours(q, k, v, jnp.asarray(mask)), jax_nn(q, k, v, jnp.asarray(mask)), atol=2e-6)
    for got, want in zip(jax.grad(loss(ours, mask), argnums=(0, 1, 2))(q, k, v),
                         jax.grad(loss(jax_nn, mask), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=2e-5)
    # negative control: the heads' masks swapped between the two query heads of a key/value head
    swapped = mask[:, [1, 0, 3, 2]]
    assert np.abs(ours(q, k, v, jnp.asarray(swapped)) - jax_nn(q, k, v, jnp.asarray(mask))).max() > 1e-2


@pytest.mark.parametrize("head_dim", [8, 64])  # the kernel's own derivative rule, and autodiff
def test_cpu_head_major_kernel_derivatives_match_the_written_out_reference_with_sinks(head_dim):
    """Reverse and forward mode, sinks included, against autodiff of `reference_attention`."""
    q, k, v = _qkv(seed=4, length=6, kv_length=9, head_dim=head_dim)  # 4 query heads over 2 key/value heads
    rng = np.random.default_rng(5)
    mask = jnp.asarray(rng.random((2, 1, 6, 9)) < 0.7).at[..., 0].set(True)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=q.shape).astype(np.float32))

    def ours(q, k, v, sinks):
        return head_major_attention(q, k, v, mask, scale=0.3, sinks=sinks)

    def written_out(q, k, v, sinks):
        return reference_attention(q, k, v, mask, scale=0.3, sinks=sinks)

    def loss(attention):
        return lambda *args: jnp.sum(jnp.sin(attention(*args)) * cotangent)

    got = jax.grad(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(loss(written_out), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=name)
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape).astype(np.float32)) for x in (q, k, v, sinks))
    primal, tangent = jax.jvp(ours, (q, k, v, sinks), tangents)
    want_primal, want_tangent = jax.jvp(written_out, (q, k, v, sinks), tangents)
    np.testing.assert_allclose(primal, want_primal, atol=2e-6)
    np.testing.assert_allclose(tangent, want_tangent, atol=2e-5)
    # negative control: the same derivatives without the sinks differ (they carry a share of each softmax)
    plain = jax.grad(loss(written_out), argnums=(0, 1, 2))(q, k, v, None)
    assert min(np.abs(a - b).max() for a, b in zip(got, plain)) > 1e-3
    assert np.abs(got[3]).min() > 1e-4  # every head's sink gets a gradient


def test_cpu_head_major_kernel_scales_the_queries_not_the_scores():
    """XLA:CPU runs the product faster bare than with the scale fused onto its scores."""
    q, k, v = _qkv(length=6, kv_length=9)  # scores [2, 2 key/value heads, 2 x 6 rows, 9 keys]
    text = jax.jit(lambda q, k, v: head_major_attention(q, k, v, None, scale=0.3)).lower(q, k, v).as_text()
    scaled = [line for line in text.splitlines() if "stablehlo.multiply" in line]
    assert scaled and all("tensor<2x6x4x8xf32>" in line for line in scaled)  # the queries alone
    # the reference kernel scales its scores: the check can see a multiply over them
    written_out = jax.jit(lambda q, k, v: reference_attention(q, k, v, None, scale=0.3)).lower(q, k, v).as_text()
    assert any("stablehlo.multiply" in line and "9xf32>" in line for line in written_out.splitlines())


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("window", [1, 3, 20])
def test_sliding_window_matches_a_per_position_loop(impl, window):
    q, k, v = _qkv(seed=1)
    got = dot_product_attention(q, k, v, causal=True, window=window, impl=impl)
    want = _naive(q, k, v, lambda b, i, j: i - window < j <= i)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_the_loop_reference_can_fail_on_an_off_by_one_window():
    q, k, v = _qkv(seed=1)
    got = dot_product_attention(q, k, v, causal=True, window=3, impl="reference")
    wrong = _naive(q, k, v, lambda b, i, j: i - 4 < j <= i)  # four keys, not three
    assert np.abs(np.asarray(got) - wrong).max() > 1e-3


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_segment_ids_block_attention_across_documents(impl):
    q, k, v = _qkv(seed=2)
    got = dot_product_attention(q, k, v, causal=True, segment_ids=SEGMENTS, impl=impl)
    want = _naive(q, k, v, lambda b, i, j: j <= i and SEGMENTS[b, i] == SEGMENTS[b, j])
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    # changing the keys/values of the last document leaves the earlier documents untouched
    k2 = k.at[0, 7:].add(3.0)
    v2 = v.at[0, 7:].add(3.0)
    moved = dot_product_attention(q, k2, v2, causal=True, segment_ids=SEGMENTS, impl=impl)
    np.testing.assert_array_equal(np.asarray(moved)[0, :7], np.asarray(got)[0, :7])
    assert np.abs(np.asarray(moved)[0, 7:] - np.asarray(got)[0, 7:]).max() > 1e-3


def test_bidirectional_attention_sees_later_keys():
    q, k, v = _qkv(seed=3)
    got = dot_product_attention(q, k, v, causal=False, impl="reference")
    np.testing.assert_allclose(np.asarray(got), _naive(q, k, v, lambda b, i, j: True), atol=2e-5)
    causal = dot_product_attention(q, k, v, causal=True, impl="reference")
    assert np.abs(np.asarray(got)[:, 0] - np.asarray(causal)[:, 0]).max() > 1e-3


def test_grouped_query_attention_shares_each_kv_head_among_consecutive_query_heads():
    q, k, v = _qkv(seed=4, heads=6, kv_heads=2)
    got = dot_product_attention(q, k, v, causal=True, impl="xla")
    full_k, full_v = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)  # HF's repeat_kv
    want = dot_product_attention(q, full_k, full_v, causal=True, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_cache_style_call_respects_positions_and_lengths(impl):
    # 2 queries at positions (3, 4) and (1, 2) over an 8-slot cache holding 5 and 3 tokens
    q, _, _ = _qkv(seed=5, length=2)
    _, k, v = _qkv(seed=6, length=8)
    q_positions = jnp.array([[3, 4], [1, 2]])
    lengths = jnp.array([5, 3])
    got = dot_product_attention(q, k, v, causal=True, window=3, q_positions=q_positions,
                                kv_positions=jnp.arange(8), kv_lengths=lengths, impl=impl)
    qp, ln = np.asarray(q_positions), np.asarray(lengths)
    want = _naive(q, k, v, lambda b, i, j: qp[b, i] - 3 < j <= qp[b, i] and j < ln[b])
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def _cache_layout(k, v):
    """[B, S, K, H] keys and values in a KVCache's layout: keys [B*K, H, S], values [B*K, S, H]."""
    batch, slots, kv_heads, head_dim = k.shape
    keys = jnp.transpose(k, (0, 2, 3, 1)).reshape(batch * kv_heads, head_dim, slots)
    values = jnp.transpose(v, (0, 2, 1, 3)).reshape(batch * kv_heads, slots, head_dim)
    return keys, values


@pytest.mark.parametrize("window", [None, 3])
def test_cache_attention_masks_by_the_position_each_slot_holds(window):
    # slots out of order, two empty (-1) and a padding slot past row 1's queries: each query sees
    # the slots holding positions it may see (causal, window), wherever they lie
    q, _, _ = _qkv(seed=8, length=2)
    _, k, v = _qkv(seed=9, length=10)
    slot_positions = np.array([[0, 1, 2, 3, 6, 4, -1, 5, -1, -1], [0, 1, 5, -1, 2, 3, 4, -1, 6, -1]])
    q_positions = np.array([[5, 6], [3, 4]])
    keys, values = _cache_layout(k, v)
    got = cache_attention(q, keys, values, q_positions=jnp.asarray(q_positions),
                          kv_positions=jnp.asarray(slot_positions), causal=True, window=window)

    def allowed(b, i, j):
        p, qp = slot_positions[b, j], q_positions[b, i]
        return p >= 0 and p <= qp and (window is None or qp - p < window)

    want = _naive(q, k, v, allowed)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    # negative control: the values in the keys' layout (a layout mix-up) are caught
    wrong = cache_attention(q, keys, jnp.swapaxes(keys, 1, 2), q_positions=jnp.asarray(q_positions),
                            kv_positions=jnp.asarray(slot_positions), causal=True, window=window)
    assert np.abs(np.asarray(wrong) - want).max() > 1e-2
    with pytest.raises(ValueError, match=r"keys \[batch \* kv_heads, 8, slots\]"):
        cache_attention(q, values, values, q_positions=jnp.asarray(q_positions),
                        kv_positions=jnp.asarray(slot_positions))


def test_queries_default_to_the_last_keys_when_shorter():
    q, k, v = _qkv(seed=7, length=10)
    full = dot_product_attention(q, k, v, causal=True, impl="reference")
    tail = dot_product_attention(q[:, 6:], k, v, causal=True, impl="reference")
    np.testing.assert_allclose(np.asarray(tail), np.asarray(full)[:, 6:], atol=1e-6)


def _gpu(capability):
    return SimpleNamespace(platform="gpu", compute_capability=capability)


def test_auto_picks_reference_for_float64_or_high_precision():
    cpu = SimpleNamespace(platform="cpu")
    assert resolve_attention_impl("auto", dtype=jnp.float64, device=cpu) == "reference"
    assert resolve_attention_impl("auto", dtype=jnp.float32, precision="highest", device=cpu) == "reference"
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST,
                                  device=_gpu("9.0")) == "reference"
    with jax.default_matmul_precision("highest"):
        assert resolve_attention_impl("auto", dtype=jnp.float32, device=cpu) == "reference"
    assert resolve_attention_impl("auto", dtype=jnp.float32, precision="default", device=cpu) == "xla"


def test_auto_picks_cudnn_only_on_a_supported_gpu_and_shape():
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=64, device=_gpu("9.0")) == "cudnn"
    assert resolve_attention_impl("auto", dtype=jnp.float16, head_dim=128, device=_gpu("8.0")) == "cudnn"
    assert resolve_attention_impl("auto", dtype=jnp.float32, head_dim=64, device=_gpu("9.0")) == "xla"
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=60, device=_gpu("9.0")) == "xla"
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=256, device=_gpu("9.0")) == "xla"
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=64, cudnn_mask_ok=False,
                                  device=_gpu("9.0")) == "xla"
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=64, device=_gpu("7.5")) == "reference"
    assert resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=64,
                                  device=SimpleNamespace(platform="cpu")) == "xla"
    assert resolve_attention_impl("auto", dtype=jnp.float32) == "xla"  # this CPU test machine


def test_an_explicit_kernel_is_kept():
    for impl in ("reference", "xla", "cudnn"):
        assert resolve_attention_impl(impl, dtype=jnp.float64) == impl


def test_bad_arguments_raise_clear_errors():
    q, k, v = _qkv(heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dot_product_attention(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="'auto', 'reference', 'xla', 'cudnn'"):
        dot_product_attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match="window"):
        dot_product_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="not both"):
        dot_product_attention(q, k, v, segment_ids=SEGMENTS, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS)


def _naive_with_sinks(q, k, v, sinks, allowed):
    """transformers' GPT-OSS eager attention in float64: one sink logit per head joins each
    query's softmax over its allowed keys and is dropped after."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for i in range(q_len):
            keys = [j for j in range(k.shape[1]) if allowed(b, i, j)]
            for h in range(heads):
                logits = np.array([q[b, i, h] @ k[b, j, h // groups] for j in keys] + [0.0]) / np.sqrt(head_dim)
                logits[-1] = sinks[h]
                weights = np.exp(logits - logits.max())
                weights = (weights / weights.sum())[:-1]
                out[b, i, h] = sum(w * v[b, j, h // groups] for w, j in zip(weights, keys))
    return out


SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_sinks_take_a_share_of_each_heads_softmax(impl, window):
    q, k, v = _qkv(seed=10)
    got = dot_product_attention(q, k, v, causal=True, window=window, sinks=jnp.asarray(SINKS), impl=impl)
    allowed = lambda b, i, j: j <= i and (window is None or i - j < window)  # noqa: E731
    want = _naive_with_sinks(q, k, v, SINKS, allowed)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    # negative control: dropping the sinks (plain softmax) is caught
    plain = dot_product_attention(q, k, v, causal=True, window=window, impl=impl)
    assert np.abs(np.asarray(plain) - want).max() > 1e-2


def test_cache_attention_applies_each_heads_sink():
    q, _, _ = _qkv(seed=11, length=2)
    _, k, v = _qkv(seed=12, length=6)
    slot_positions = np.array([[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]])
    q_positions = np.array([[3, 4], [2, 3]])
    keys, values = _cache_layout(k, v)
    got = cache_attention(q, keys, values, q_positions=jnp.asarray(q_positions),
                          kv_positions=jnp.asarray(slot_positions), window=2, sinks=jnp.asarray(SINKS))

    def allowed(b, i, j):
        p, qp = slot_positions[b, j], q_positions[b, i]
        return 0 <= p <= qp and qp - p < 2

    want = _naive_with_sinks(q, k, v, SINKS, allowed)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    swapped = cache_attention(q, keys, values, q_positions=jnp.asarray(q_positions),
                              kv_positions=jnp.asarray(slot_positions), window=2, sinks=jnp.asarray(SINKS[::-1]))
    assert np.abs(np.asarray(swapped) - want).max() > 1e-2  # each head reads its own sink
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        dot_product_attention(q, q, q, sinks=jnp.zeros(3))
