"""Scaled dot-product attention with a choice of kernel.

One function, `dot_product_attention`, serves every model in Dew. It takes queries
``[batch, q_len, heads, head_dim]`` and keys/values ``[batch, kv_len, kv_heads, head_dim]``
(grouped-query attention when ``kv_heads`` divides ``heads``) and decides which keys each query
may see from four plain rules:

* causal: a query never sees a key at a later position;
* window ``w``: a query sees at most ``w`` keys, its own position included (keys at positions
  ``q - w + 1 .. q``), as in Mistral/Gemma sliding-window layers;
* segment ids: a query sees only keys of its own document when several are packed in one row;
* ``kv_lengths``: key slots at or past a row's length are empty (a KV cache not yet filled).

``sinks`` (one learned logit per query head, GPT-OSS's attention sinks) adds a column to every
query's scores that takes a share of the softmax but has no value: the weights over the real keys
then sum to less than one, so a head can attend to nothing (Xiao et al. 2023, arXiv:2309.17453).

The kernel is a separate choice (``impl``) and never changes the result beyond rounding, nor any
parameter: "reference" is a float32 einsum and softmax written out below, "xla" and "cudnn" go
through `jax.nn.dot_product_attention` ("xla" on a CPU through `head_major_attention`, the same
computation in the operand layout XLA:CPU runs fastest), "blockwise" (`blockwise_attention`) never
holds a whole ``[queries, keys]`` score matrix, forward or backward, and "auto" picks one per call
(`resolve_attention_impl`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count, one_of
from dew.nn.kv_quant import Quantized, rotate

ATTENTION_IMPLS = ("auto", "reference", "xla", "cudnn", "blockwise")

# "auto" runs "blockwise" off a GPU from this many keys on. On XLA:CPU neither kernel is reliably
# faster at 1-2 thousand keys; from 4096 the one-shot kernel's scores take gigabytes and it is the
# slower one, 2-7x in the forward pass of the first attention level of a UNet at 512 px (4096
# positions, heads of 8 to 64), forward and backward for a causal decoder (docs/scaling.md).
BLOCKWISE_MIN_KEYS = 4096
# queries and keys per block of "blockwise" for heads of 64 or more (one block's float32 scores per
# head are 1 MiB); narrower heads take blocks of half as many, whose products are otherwise too thin
# to pay for the block's softmax bookkeeping (about 2x faster at head_dim 8-40 on XLA:CPU)
BLOCKWISE_BLOCK = 512
# `head_major_attention` differentiates heads narrower than this through `_head_major_core`'s rule,
# which runs the backward products over query positions on transposed copies (see there)
TRANSPOSED_DERIVATIVE_BELOW = 64
# on a CPU, an unmasked "blockwise" call's forward pass runs each key/value head's queries in
# blocks of this many scores against all of its keys at once (a block of 512 rows at 4096 keys is
# 8 MiB of float32), while a block holds at least `ROWWISE_MIN_ROWS` rows; longer key sequences
# take the online softmax over key blocks
ROWWISE_SCORES = 1 << 21
ROWWISE_MIN_ROWS = 64
# the rows path offsets a block's scores by a bound on their maxima when it lies within this many
# of a score of each row (among the first `ROWWISE_BOUND_SAMPLE` of the row), else by the maxima
ROWWISE_BOUND_GAP = 60.0
ROWWISE_BOUND_SAMPLE = 256
# "auto" runs "blockwise" on a CPU from this many keys on for a call the rows path takes (no rule
# to apply, keys in whole blocks): it is faster than the one-shot kernel there, forward and backward
# (1.06-1.8x forward and backward at 1024-2048 keys, heads of 16 and 64; docs/scaling.md)
ROWWISE_MIN_KEYS = 1024

# matmul precisions that ask for more than the default (bf16 passes on GPU/TPU)
_HIGH_PRECISIONS = ("high", "highest", "float32", "tensorfloat32", "bfloat16_3x")


def check_attention_impl(impl: str) -> str:
    """Return `impl` if Dew knows it, else raise a ValueError listing the kernels it knows."""
    return one_of(impl, ATTENTION_IMPLS, "attention_impl", what="a known attention kernel")


def _asks_for_high_precision(precision: Any) -> bool:
    """True when a matmul precision above the default is requested (argument or global config)."""
    candidates = [precision]
    if precision is None:
        candidates.append(jax.config.jax_default_matmul_precision)
    for p in candidates:
        if p is None:
            continue
        if isinstance(p, (tuple, list)):
            if any(_asks_for_high_precision(x) for x in p):
                return True
            continue
        if isinstance(p, jax.lax.Precision):
            if p != jax.lax.Precision.DEFAULT:
                return True
            continue
        if str(p).lower() in _HIGH_PRECISIONS:
            return True
    return False


def _compute_capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA device, or None when it is not one or does not say."""
    if getattr(device, "platform", None) != "gpu":
        return None
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return None
    try:
        major, _, minor = str(capability).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        return None


def resolve_attention_impl(
    impl: str = "auto",
    *,
    dtype: Any = jnp.float32,
    head_dim: int | None = None,
    precision: Any = None,
    cudnn_mask_ok: bool = True,
    device: Any = None,
    kv_len: int | None = None,
    rows_ok: bool = False,
) -> str:
    """The kernel a call with these properties runs: "reference", "xla", "cudnn" or "blockwise".

    An explicit ``impl`` is returned unchanged. For "auto" the order is:

    1. "reference" when the call asks for arithmetic no fused kernel does: float64 inputs, or a
       matmul precision above the default (argument or ``jax_default_matmul_precision``), or
       half precision on an NVIDIA GPU older than sm80.
    2. "cudnn" on an NVIDIA GPU of sm80 or newer, for bf16/fp16 inputs whose head_dim cuDNN's
       flash kernel takes (a multiple of 8, at most 128) and whose mask it can express
       (``cudnn_mask_ok``: causal/window/lengths, no segment ids, no arbitrary mask).
    3. "blockwise" off a GPU when ``kv_len`` reaches `BLOCKWISE_MIN_KEYS`, where XLA would
       materialize scores the size of queries times keys, and on a CPU from `ROWWISE_MIN_KEYS`
       when the call would run its rows path (``rows_ok``: no rule to apply, keys in whole blocks).
    4. "xla" otherwise.

    ``device`` defaults to the first device of the default backend; tests pass a stand-in object
    with ``platform`` and ``compute_capability`` attributes.
    """
    check_attention_impl(impl)
    if impl != "auto":
        return impl
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64 or _asks_for_high_precision(precision):
        return "reference"
    if device is None:
        device = jax.devices()[0]
    capability = _compute_capability(device)
    half = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if capability is not None and half:
        if capability < (8, 0):
            return "reference"
        head_dim_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= 128)
        if head_dim_ok and cudnn_mask_ok:
            return "cudnn"
    platform = getattr(device, "platform", None)
    if platform != "gpu" and kv_len is not None and kv_len >= BLOCKWISE_MIN_KEYS:
        return "blockwise"
    if platform == "cpu" and rows_ok and kv_len is not None and kv_len >= ROWWISE_MIN_KEYS:
        return "blockwise"
    return "xla"


def attention_mask(
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    causal: bool,
    window: int | jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
) -> jax.Array:
    """Boolean ``[batch, 1, q_len, kv_len]`` mask, True where a query may attend to a key.

    Positions are ``[batch, len]`` (or ``[len]``) integers. ``window`` may be a traced integer
    (a scanned stack of layers with different windows); a window of 0 or None means no window.
    """
    q_pos = jnp.atleast_2d(q_positions)[:, :, None]  # [B, T, 1]
    kv_pos = jnp.atleast_2d(kv_positions)[:, None, :]  # [B, 1, S]
    mask = jnp.ones(jnp.broadcast_shapes(q_pos.shape, kv_pos.shape), dtype=bool)
    if causal:
        mask &= kv_pos <= q_pos
    if window is not None:
        distance = q_pos - kv_pos  # >= 0 for keys behind the query
        in_window = distance < window
        if not causal:
            in_window &= -distance < window  # symmetric window without causality
        if isinstance(window, int):
            mask &= in_window
        else:  # traced window: 0 switches it off
            mask &= in_window | (window <= 0)
    if q_segment_ids is not None or kv_segment_ids is not None:
        if q_segment_ids is None or kv_segment_ids is None:
            raise ValueError("pass both q_segment_ids and kv_segment_ids (or segment_ids)")
        q_seg = jnp.atleast_2d(q_segment_ids)[:, :, None]
        kv_seg = jnp.atleast_2d(kv_segment_ids)[:, None, :]
        mask &= q_seg == kv_seg
    if kv_lengths is not None:
        slots = jnp.arange(kv_pos.shape[-1])[None, None, :]
        mask &= slots < jnp.asarray(kv_lengths)[:, None, None]
    return mask[:, None, :, :]


def softmax_with_sinks(logits: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis with one extra logit per row (``sinks``, broadcast to
    ``logits.shape[:-1]``) whose weight is dropped after: the attention weights of the keys alone.

    Without sinks this is the plain softmax. With them it is transformers' GPT-OSS eager attention:
    ``softmax(concat(logits, sink))[..., :-1]``.
    """
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    column = jnp.broadcast_to(sinks.astype(logits.dtype)[..., None], logits.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]


def _check_sinks(sinks: jax.Array | None, heads: int) -> jax.Array | None:
    if sinks is not None and tuple(jnp.shape(sinks)) != (heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({heads},); got {jnp.shape(sinks)}")
    return None if sinks is None else jnp.asarray(sinks)


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    scale: float,
    precision: Any = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale, masked) v in float32, written out; the check for every kernel.
    ``sinks [heads]``: each head's sink logit (see `softmax_with_sinks`)."""
    batch, q_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    # query head h reads kv head h // groups, as in jax.nn.dot_product_attention and HF's repeat_kv
    qg = q.astype(jnp.float32).reshape(batch, q_len, kv_heads, groups, head_dim)
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", qg, k.astype(jnp.float32), precision=precision
    ) * jnp.float32(scale)
    if mask is not None:
        # mask is [B or 1, 1 or heads, T, S]; bring it to [B, kv_heads, groups, T, S]
        m = jnp.broadcast_to(mask, (mask.shape[0], heads) + mask.shape[2:])
        m = m.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:])
        logits = jnp.where(m, logits, jnp.finfo(jnp.float32).min)
    head_sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, groups, 1)
    weights = softmax_with_sinks(logits, head_sinks)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v.astype(jnp.float32), precision=precision)
    return out.reshape(batch, q_len, heads, head_dim).astype(q.dtype)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    precision: Any = None,
    impl: str = "auto",
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of ``q [B, T, N, H]`` over ``k, v [B, S, K, H]``; returns ``[B, T, N, H]``.

    Without positions, query i sits at key position ``S - T + i`` (the last T keys), so a
    plain self-attention call (T == S) lines queries up with keys. ``segment_ids`` is the
    self-attention shorthand for equal ``q_segment_ids`` and ``kv_segment_ids``. ``mask`` is an
    extra boolean mask broadcastable to ``[B, N, T, S]``, combined with the rules above.
    ``scale`` defaults to ``1 / sqrt(H)``. ``sinks [N]``: each head's sink logit (no fused kernel
    takes one, so a call with sinks runs "reference", "blockwise" or, otherwise, `head_major_attention`).
    """
    check_attention_impl(impl)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q [batch, len, heads, head_dim] and k, v [batch, len, kv_heads, "
            f"head_dim]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k and v must be [{batch}, len, kv_heads, {head_dim}]; got {k.shape}, {v.shape}")
    if heads % kv_heads:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_kv_heads ({kv_heads})")
    sinks = _check_sinks(sinks, heads)
    if isinstance(window, numbers.Number):  # a host scalar; a traced window is checked by its use
        window = count(window, "window (the number of keys a query sees)")
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError("pass segment_ids or q_segment_ids/kv_segment_ids, not both")
        q_segment_ids = kv_segment_ids = segment_ids
    scale = float(1.0 / np.sqrt(head_dim)) if scale is None else float(scale)

    default_positions = q_positions is None and kv_positions is None
    if kv_positions is None:
        kv_positions = jnp.arange(kv_len, dtype=jnp.int32)
    if q_positions is None:
        q_positions = jnp.arange(q_len, dtype=jnp.int32) + (kv_len - q_len)

    # cuDNN gets the mask as flags (causal, window, lengths) only for plain self-attention
    cudnn_mask_ok = (
        default_positions and q_len == kv_len and q_segment_ids is None and mask is None
        and (window is None or isinstance(window, int)) and (causal or window is None) and sinks is None
    )
    unmasked = _sees_every_key(causal, window, q_segment_ids, kv_lengths, mask)
    rows_ok = unmasked and kv_len % min(_default_block(head_dim), kv_len) == 0  # `blockwise_attention`'s rows path
    kernel = resolve_attention_impl(
        impl, dtype=q.dtype, head_dim=head_dim, precision=precision, cudnn_mask_ok=cudnn_mask_ok, kv_len=kv_len,
        rows_ok=rows_ok,
    )

    if kernel == "cudnn" and cudnn_mask_ok:
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal,
            key_value_seq_lengths=None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32),
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn",
        )

    if kernel == "blockwise":
        return blockwise_attention(
            q, k, v, q_positions=q_positions, kv_positions=kv_positions, causal=causal, window=window,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths, mask=mask,
            scale=scale, precision=precision, sinks=sinks,
        )
    full_mask = None
    if not unmasked:
        full_mask = attention_mask(
            q_positions, kv_positions, causal=causal, window=window,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
        )
        if mask is not None:
            full_mask = full_mask & jnp.asarray(mask, bool)
    if kernel == "reference":
        return reference_attention(q, k, v, full_mask, scale=scale, precision=precision, sinks=sinks)
    if _on_cpu() or sinks is not None:
        return head_major_attention(q, k, v, full_mask, scale=scale, sinks=sinks)
    return jax.nn.dot_product_attention(
        q, k, v, mask=full_mask, scale=scale, implementation=kernel
    )


def _sees_every_key(causal, window, q_segment_ids, kv_lengths, mask) -> bool:
    """Whether a call has no rule to apply: bidirectional, with no window, segments, lengths or mask."""
    return not causal and window is None and q_segment_ids is None and kv_lengths is None and mask is None


def _default_block(head_dim: int) -> int:
    """`blockwise_attention`'s block for heads of `head_dim`: `BLOCKWISE_BLOCK`, half that below 64."""
    return BLOCKWISE_BLOCK if head_dim >= 64 else max(1, BLOCKWISE_BLOCK // 2)


def _on_cpu() -> bool:
    """Whether the default backend's devices are CPUs (the kernels' CPU-only forms)."""
    return jax.devices()[0].platform == "cpu"


def _scaled_queries(q: jax.Array, scale: float, dtype: Any) -> jax.Array:
    """``q * scale`` in `dtype`: the head-major and blockwise kernels scale the queries, not the scores.

    ``(q * scale) k^T`` is the same product with ``T x H`` multiplies instead of ``T x S``, and it
    leaves XLA:CPU a bare product to hand to YNNPACK, where a scale on the scores joined the
    product's fusion and slowed it: the forward pass of batch 2 at 4096 tokens with 8 heads of 8
    (`_rowwise_forward`) took 176 against 215 ms, 196 against 243 ms with heads of 16, and the
    head-major kernel's forward and backward pass of 8 heads of 64 over 256 tokens 27 against 33
    ms (medians of 7-9 calls, 2-core host). Gradients reach ``q`` through the multiply.
    """
    return q.astype(dtype) * jnp.asarray(scale, dtype)


def head_major_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, *,
                         scale: float, sinks: jax.Array | None = None) -> jax.Array:
    """The "xla" kernel on CPU: softmax(q k^T * scale, masked) v with the heads moved in front.

    XLA:CPU runs the two batched products fastest, forward and backward, on ``[B, heads, T, H]``
    operands (one transpose of each input and of the output) rather than on the ``[B, T, heads,
    H]`` tokens as they come (`jax.nn.dot_product_attention`'s form): 20-30% less time for the
    short contexts of the training benchmarks (benchmarks/README.md). A key/value head's query
    heads are folded into the query length, so grouped-query attention needs no repeated keys.
    The scores and softmax are in the inputs' dtype, as in `jax.nn.dot_product_attention`.
    ``sinks [heads]``: each head's sink logit (see `softmax_with_sinks`). Heads narrower than
    `TRANSPOSED_DERIVATIVE_BELOW` take their derivatives from `_head_major_core`'s own rule
    (forward and reverse mode); wider heads from autodiff of the same computation.
    """
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    qh = _scaled_queries(q, scale, q.dtype).reshape(batch, q_len, kv_heads, groups, head_dim)
    qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * q_len, head_dim)
    if mask is not None:  # [B or 1, 1 or heads, T, S] -> the scores' [B or 1, K or 1, G * T, S]
        mask = jnp.asarray(mask, bool)
        if groups > 1 or mask.shape[1] != 1:
            mask = jnp.broadcast_to(mask, (mask.shape[0], heads) + mask.shape[2:])
            mask = mask.reshape(mask.shape[0], kv_heads, groups * q_len, kv_len)
    row_sinks = None if sinks is None else jnp.repeat(sinks.reshape(kv_heads, groups), q_len, axis=1)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if head_dim < TRANSPOSED_DERIVATIVE_BELOW:
        out = _head_major_core(qh, kh, vh, mask, row_sinks)
    else:
        out = _head_major_scores(qh, kh, vh, mask, row_sinks)[0]
    out = out.reshape(batch, kv_heads, groups, q_len, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, heads, head_dim)


def _head_major_scores(q, k, v, mask, row_sinks):
    """(output, weights) of head-major attention: q [B, K, T, H] already scaled, k and v [B, K, S, H]."""
    logits = jnp.einsum("bkth,bksh->bkts", q, k)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    weights = softmax_with_sinks(logits, row_sinks)  # [K, G * T] sinks, one per query row
    return jnp.einsum("bkts,bksh->bkth", weights, v), weights


@jax.custom_jvp
def _head_major_core(q, k, v, mask, row_sinks):
    return _head_major_scores(q, k, v, mask, row_sinks)[0]


def _transposed(x: jax.Array) -> jax.Array:
    """``x`` with its last two axes swapped, behind a barrier so XLA keeps the swap, and in the
    reverse pass keeps it as a copy of the cotangent."""
    return jnp.swapaxes(jax.lax.optimization_barrier(x), -1, -2)


@_head_major_core.defjvp
def _head_major_core_jvp(primals, tangents):
    """The derivative written so that its transpose (the backward pass) gives every product its
    contracted axis last on the left operand.

    The two backward products that contract over query positions (``dk = ds^T q`` and ``dv =
    w^T do``) would otherwise read the scores' cotangent and the weights down their columns: the
    form XLA:CPU cannot hand to its fast matrix kernels (YNNPACK), which ran them at about half the
    speed. Here their tangents are computed transposed and swapped back behind a barrier, so the
    backward pass copies the cotangent into the transposed layout once and multiplies row-major.
    That pays for its two copies only while the heads are narrow: the op time of a forward and
    backward call at 64-256 tokens went down by 15-27% for heads of 16 and 32, and for heads of 64
    from 4% down at 96 tokens to 15% up at 256 (`TRANSPOSED_DERIVATIVE_BELOW`).
    """
    q, k, v, mask, row_sinks = primals
    dq, dk, dv, _, dsinks = tangents
    out, weights = _head_major_scores(q, k, v, mask, row_sinks)
    dlogits = jnp.einsum("bkth,bksh->bkts", dq, k) + _transposed(jnp.einsum("bksh,bkth->bkst", dk, q))
    mean = jnp.sum(weights * dlogits, axis=-1, keepdims=True)
    if row_sinks is not None:  # the sink column's share of the softmax is 1 - sum(weights)
        sink_share = 1 - jnp.sum(weights, axis=-1, keepdims=True)
        mean = mean + sink_share * dsinks.astype(weights.dtype)[..., None]
    dweights = weights * (dlogits - mean)
    dout = jnp.einsum("bkts,bksh->bkth", dweights, v) + _transposed(jnp.einsum("bksh,bkts->bkht", dv, weights))
    return out, dout


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    causal: bool,
    window: int | jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float,
    precision: Any = None,
    sinks: jax.Array | None = None,
    block: int | None = None,
) -> jax.Array:
    """The "blockwise" kernel: `dot_product_attention`'s result without a ``[queries, keys]`` score matrix.

    Queries go in blocks of `block` (a `lax.map`), and each block runs an online softmax over blocks
    of `block` keys (a `lax.scan`: a running maximum, sum and weighted sum of values, rescaled as
    the maximum grows; Milakov & Gimelshein 2018, arXiv:1805.02867), so only one block's scores
    exist at a time; `block` defaults to `BLOCKWISE_BLOCK` (half that below head_dim 64). The
    backward pass (a `jax.custom_vjp`) keeps the inputs, the output and each query's log-sum-exp,
    and recomputes each block's scores, as FlashAttention does (Dao et al. 2022, arXiv:2205.14135).
    Scores, softmax and sums are float32, as in `reference_attention`,
    masked keys score ``finfo.min`` as there (a query that may see no key averages them all), and a
    sink rescales the output by its share of the softmax afterwards (outside the custom gradient, so
    JAX differentiates it, and sums its gradient over the devices a `shard_map` splits queries over).
    """
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    block = count(_default_block(head_dim) if block is None else block, "block")
    q_block, kv_block = min(block, q_len), min(block, kv_len)
    q_pad, kv_pad = -q_len % q_block, -kv_len % kv_block

    def pad(x, axis, extra):  # lengths up to whole blocks; padded keys are masked out below
        return x if extra == 0 else jnp.pad(x, [(0, extra) if d == axis else (0, 0) for d in range(x.ndim)])

    # [B, T, N, H] -> [B, K, G, T, H]: a key/value head's query heads next to each other, scaled
    # before any product (`_scaled_queries`)
    qh = _scaled_queries(q, scale, jnp.float32).reshape(batch, q_len, kv_heads, groups, head_dim)
    qh = pad(qh.transpose(0, 2, 3, 1, 4), 3, q_pad)
    kh, vh = (pad(x.transpose(0, 2, 1, 3), 2, kv_pad) for x in (k, v))  # [B, K, S, H]
    rules = {
        "q_positions": pad(jnp.atleast_2d(q_positions), 1, q_pad),
        "kv_positions": pad(jnp.atleast_2d(kv_positions), 1, kv_pad),
        "window": None if window is None else jnp.asarray(window, jnp.int32),
        "q_segment_ids": None if q_segment_ids is None else pad(jnp.atleast_2d(q_segment_ids), 1, q_pad),
        "kv_segment_ids": None if kv_segment_ids is None else pad(jnp.atleast_2d(kv_segment_ids), 1, kv_pad),
        "kv_lengths": None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32),
        "mask": None if mask is None else _head_grouped_mask(mask, heads, kv_heads, q_pad, kv_pad),
    }
    unmasked = _sees_every_key(causal, window, q_segment_ids, kv_lengths, mask) and kv_pad == 0
    rows = groups * (q_len + q_pad)  # a key/value head's query rows
    row_block = min(rows, ROWWISE_SCORES // kv_len)
    rowwise = unmasked and row_block >= min(ROWWISE_MIN_ROWS, rows) and _on_cpu()
    shape = _BlockShape(causal=causal, q_block=q_block, kv_block=kv_block, kv_len=kv_len,
                        precision=precision, unmasked=unmasked, row_block=row_block if rowwise else 0)
    out, lse = _blockwise(shape, qh, kh, vh, rules)
    if sinks is not None:  # the sink joins each softmax as one more column, with no value
        sink = sinks.astype(jnp.float32).reshape(kv_heads, groups)[None, :, :, None]
        out = out * jnp.exp(lse - jnp.logaddexp(lse, sink))[..., None]
    out = out[..., :q_len, :]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads, head_dim).astype(q.dtype)


def _head_grouped_mask(mask: jax.Array, heads: int, kv_heads: int, q_pad: int, kv_pad: int) -> jax.Array:
    """An extra mask broadcastable to ``[B, N, T, S]`` as ``[B or 1, K or 1, G or 1, T or 1, S or 1]``,
    its lengths padded to whole blocks."""
    mask = jnp.asarray(mask, bool)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if mask.shape[1] == 1:
        mask = mask[:, :, None]
    else:
        mask = jnp.broadcast_to(mask, mask.shape[:1] + (heads,) + mask.shape[2:])
        mask = mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])
    for axis, extra in ((3, q_pad), (4, kv_pad)):
        if mask.shape[axis] > 1 and extra:
            mask = jnp.pad(mask, [(0, extra) if d == axis else (0, 0) for d in range(5)])
    return mask


@dataclasses.dataclass(frozen=True)
class _BlockShape:
    """The static settings of one blockwise call (hashable: `jax.custom_vjp` takes it as static)."""

    causal: bool
    q_block: int
    kv_block: int
    kv_len: int  # keys before padding to whole blocks
    precision: Any = None
    unmasked: bool = False  # every query sees every key and no key is padding: no mask to build
    row_block: int = 0  # rows of an unmasked forward pass's blocks on a CPU; 0: blocks of keys


def _block_scores(shape: _BlockShape, rules: dict, q_blk, k_blk, q_index, kv_index):
    """The float32 scores ``[B, K, G, bq, bk]`` of query block `q_index` against key block
    `kv_index`, and where the rules let a query see a key (True) or the key is only padding (None
    for an unmasked call, which builds no mask)."""
    scores = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk.astype(jnp.float32), precision=shape.precision)
    if shape.unmasked:
        return scores, None
    q_start, kv_start = q_index * shape.q_block, kv_index * shape.kv_block
    take = lambda x, start, size: jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)  # noqa: E731
    segments = {}
    if rules["q_segment_ids"] is not None:
        segments = dict(q_segment_ids=take(rules["q_segment_ids"], q_start, shape.q_block),
                        kv_segment_ids=take(rules["kv_segment_ids"], kv_start, shape.kv_block))
    allowed = attention_mask(
        take(rules["q_positions"], q_start, shape.q_block), take(rules["kv_positions"], kv_start, shape.kv_block),
        causal=shape.causal, window=rules["window"], **segments,
    )[:, :, None]  # [B or 1, 1, 1, bq, bk]
    slots = kv_start + jnp.arange(shape.kv_block)
    if rules["kv_lengths"] is not None:
        allowed &= (slots[None, :] < rules["kv_lengths"][:, None])[:, None, None, None, :]
    extra = rules["mask"]
    if extra is not None:
        if extra.shape[3] > 1:
            extra = jax.lax.dynamic_slice_in_dim(extra, q_start, shape.q_block, axis=3)
        if extra.shape[4] > 1:
            extra = jax.lax.dynamic_slice_in_dim(extra, kv_start, shape.kv_block, axis=4)
        allowed &= extra
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    real = slots < shape.kv_len  # padding past the last key takes no share of any softmax
    return jnp.where(real, scores, -jnp.inf), allowed & real


def _blocks(x: jax.Array, axis: int, size: int) -> jax.Array:
    """``x`` cut along `axis` into blocks of `size`, the block index moved to the front."""
    x = x.reshape(x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of `_blocks`: the leading block index merged back into `axis`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _key_blocks(shape: _BlockShape, kh, vh):
    """Keys and values ``[B, K, S, H]`` as blocks ``[S / bk, B, K, bk, H]``, with each block's index."""
    blocks = kh.shape[2] // shape.kv_block
    return _blocks(kh, 2, shape.kv_block), _blocks(vh, 2, shape.kv_block), jnp.arange(blocks)


def _blockwise_forward(shape: _BlockShape, qh, kh, vh, rules):
    """Output ``[B, K, G, T, H]`` and each query's log-sum-exp ``[B, K, G, T]``, both float32."""
    if shape.row_block:
        return _rowwise_forward(shape, qh, kh, vh)
    kv_blocks = _key_blocks(shape, kh, vh)

    def query_block(args):
        q_blk, q_index = args
        # running maximum and sum per query; `*_like` keeps the queries' device variance in a shard_map
        total = jnp.zeros_like(q_blk[..., 0], jnp.float32)
        top = total - jnp.inf

        def key_block(carry, blk):
            top, total, acc = carry
            k_blk, v_blk, kv_index = blk
            scores, _ = _block_scores(shape, rules, q_blk, k_blk, q_index, kv_index)
            new_top = jnp.maximum(top, scores.max(-1))
            weights = jnp.exp(scores - new_top[..., None])
            rescale = jnp.exp(top - new_top)
            acc = acc * rescale[..., None] + jnp.einsum("bkgqs,bksh->bkgqh", weights, v_blk.astype(jnp.float32),
                                                        precision=shape.precision)
            return (new_top, total * rescale + weights.sum(-1), acc), None

        acc = jnp.zeros_like(q_blk, jnp.float32)
        (top, total, acc), _ = jax.lax.scan(key_block, (top, total, acc), kv_blocks)
        return acc / total[..., None], top + jnp.log(total)

    q_blocks = (_blocks(qh, 3, shape.q_block), jnp.arange(qh.shape[3] // shape.q_block))
    out, lse = jax.lax.map(query_block, q_blocks)
    return _unblocks(out, 3), _unblocks(lse, 3)


def _rowwise_forward(shape: _BlockShape, qh, kh, vh):
    """`_blockwise_forward` for an unmasked call on a CPU: one key/value head at a time, its query
    rows (all of its query heads') in blocks of `_BlockShape.row_block`, each block's scores against
    all the keys at once and a plain softmax over them.

    XLA:CPU runs these two-dimensional products and one-pass softmaxes faster than the online
    softmax over key blocks with every head batched into each op: 116 against 282 ms for the forward
    pass of batch 2 at 4096 tokens with 8 heads of 8 (a UNet's first level at 512 px), 138 against
    332 ms with heads of 16 (medians of 5, 2-core host; docs/scaling.md).
    """
    keys, values = _head_rows(kh), _head_rows(vh)
    einsum = functools.partial(jnp.einsum, precision=shape.precision)

    def head(args):
        q_blocks, k, v = args
        key_norm = jnp.sqrt(jnp.max(jnp.sum(k * k, axis=-1)))

        def row_block(q_blk):
            scores = einsum("qh,sh->qs", q_blk, k)
            top = _softmax_offsets(scores, jnp.sqrt(jnp.sum(q_blk * q_blk, axis=-1)) * key_norm)
            weights = jnp.exp(scores - top[:, None])
            total = weights.sum(-1)
            return einsum("qs,sh->qh", weights, v) / total[:, None], top + jnp.log(total)

        return jax.lax.map(row_block, q_blocks)

    out, lse = jax.lax.map(head, (_row_blocks(qh, shape.row_block), keys, values))
    return _from_row_blocks(out, qh.shape), _from_row_blocks(lse, qh.shape[:-1])


def _softmax_offsets(scores: jax.Array, bound: jax.Array) -> jax.Array:
    """What each row of `scores` ``[rows, keys]`` subtracts before its softmax's exponentials:
    `bound` ``[rows]`` (``|q| max |k|``, at least every score of its row by Cauchy-Schwarz) where
    it lies within `ROWWISE_BOUND_GAP` of a score of every row of the block, else the rows' maxima.

    Any offset at least a row's largest score keeps its exponentials from overflowing, and one
    within the gap of it keeps every weight above ``e^-(87 - gap)`` (2e-12 at a gap of 60) of
    the row's largest a normal float32 number, so only weights below that can flush to zero. The
    bound spares a pass over the block's scores (the maxima's reduction): the forward pass of
    batch 2 at 4096 tokens with 8 heads of 8 took 140-151 against 155-181 ms (2-core AMD host,
    alternating processes). The first `ROWWISE_BOUND_SAMPLE` scores of a row (a lower bound on
    its maximum) decide, for the whole block, which offset it takes.
    """
    seen = scores[:, :ROWWISE_BOUND_SAMPLE].max(-1)
    return jax.lax.cond(jnp.all(bound - seen <= ROWWISE_BOUND_GAP), lambda: bound, lambda: scores.max(-1))


def _head_rows(x: jax.Array) -> jax.Array:
    """Keys or values ``[B, K, S, H]`` as float32 ``[B * K, S, H]``: one entry per key/value head."""
    return x.reshape(-1, *x.shape[2:]).astype(jnp.float32)


def _row_blocks(x: jax.Array, block: int) -> jax.Array:
    """Per-query values ``[B, K, G, T, ...]`` as ``[B * K, blocks, block, ...]``: each key/value
    head's rows (all of its query heads'), padded with zeros to whole blocks of `block`."""
    rows = x.shape[2] * x.shape[3]
    x = x.reshape(x.shape[0] * x.shape[1], rows, *x.shape[4:])
    x = jnp.pad(x, [(0, 0), (0, -rows % block)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], -1, block, *x.shape[2:])


def _from_row_blocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `_row_blocks`: the padding rows dropped, ``shape`` restored."""
    batch, kv_heads, groups, q_len = shape[:4]
    x = x.reshape(batch, kv_heads, -1, *x.shape[3:])[:, :, :groups * q_len]
    return x.reshape(shape)


def _rowwise_backward(shape: _BlockShape, qh, kh, vh, lse, d_out, row_dot):
    """`_blockwise_bwd` for an unmasked call on a CPU, over the row blocks of `_rowwise_forward`.

    Each block's weights are recomputed twice, once with the keys along the rows (for the key and
    value gradients, whose products sum over query rows) and once with the queries along the rows
    (for the query gradient), so every product contracts the last axis of its left operand: the
    form XLA:CPU hands to its fast matrix kernels. One pass with a product down the columns
    instead, or the key blocks' online form, took longer (docs/scaling.md).
    """
    einsum = functools.partial(jnp.einsum, precision=shape.precision)

    def head(args):  # one key/value head: its keys and values, and its rows' blocks
        k, v, q_blocks, lse_blocks, d_out_blocks, row_dot_blocks = args

        def row_block(carry, blk):
            d_k, d_v = carry
            q_blk, lse_blk, d_out_blk, row_dot_blk = blk
            weights_t = jnp.exp(einsum("sh,qh->sq", k, q_blk) - lse_blk[None, :])
            d_v = d_v + einsum("sq,qh->sh", weights_t, d_out_blk)
            d_scores_t = weights_t * (einsum("sh,qh->sq", v, d_out_blk) - row_dot_blk[None, :])
            d_k = d_k + einsum("sq,qh->sh", d_scores_t, q_blk)
            weights = jnp.exp(einsum("qh,sh->qs", q_blk, k) - lse_blk[:, None])
            d_scores = weights * (einsum("qh,sh->qs", d_out_blk, v) - row_dot_blk[:, None])
            return (d_k, d_v), einsum("qs,sh->qh", d_scores, k)

        zeros = jnp.zeros_like(k)
        (d_k, d_v), d_q = jax.lax.scan(row_block, (zeros, zeros), (q_blocks, lse_blocks, d_out_blocks, row_dot_blocks))
        return d_q, d_k, d_v

    per_head = (_head_rows(kh), _head_rows(vh), _row_blocks(qh, shape.row_block), _row_blocks(lse, shape.row_block),
                _row_blocks(d_out, shape.row_block), _row_blocks(row_dot, shape.row_block))
    d_q, d_k, d_v = jax.lax.map(head, per_head)
    return _from_row_blocks(d_q, qh.shape), d_k.reshape(kh.shape), d_v.reshape(vh.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(shape: _BlockShape, qh, kh, vh, rules):
    return _blockwise_forward(shape, qh, kh, vh, rules)


def _blockwise_fwd(shape, qh, kh, vh, rules):
    out, lse = _blockwise_forward(shape, qh, kh, vh, rules)
    return (out, lse), (qh, kh, vh, rules, out, lse)


def _blockwise_bwd(shape, residuals, cotangents):
    """Gradients from each block's recomputed scores: for every key block, a pass over the query
    blocks that adds to that block's key and value gradients and to the queries' gradient."""
    qh, kh, vh, rules, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = d_out.astype(jnp.float32)
    # [B, K, G, T]: what the softmax's normalization takes from each of a row's score gradients,
    # out . d_out, less the log-sum-exp's own cotangent (a score moves the lse by its weight)
    row_dot = jnp.sum(d_out * out, axis=-1) - d_lse.astype(jnp.float32)
    d_rules = jax.tree_util.tree_map(lambda _: None, rules)
    if shape.row_block:
        d_q, d_k, d_v = _rowwise_backward(shape, qh, kh, vh, lse, d_out, row_dot)
        return d_q.astype(qh.dtype), d_k.astype(kh.dtype), d_v.astype(vh.dtype), d_rules
    q_blocks, lse_blocks = _blocks(qh, 3, shape.q_block), _blocks(lse, 3, shape.q_block)
    d_out_blocks, row_dot_blocks = _blocks(d_out, 3, shape.q_block), _blocks(row_dot, 3, shape.q_block)
    einsum = functools.partial(jnp.einsum, precision=shape.precision)

    def key_block(d_q, blk):
        k_blk, v_blk, kv_index = blk
        k32, v32 = k_blk.astype(jnp.float32), v_blk.astype(jnp.float32)

        def query_block(carry, q_index):
            d_k, d_v, d_q = carry
            q_blk = q_blocks[q_index]
            scores, allowed = _block_scores(shape, rules, q_blk, k_blk, q_index, kv_index)
            weights = jnp.exp(scores - lse_blocks[q_index][..., None])
            d_v = d_v + einsum("bkgqs,bkgqh->bksh", weights, d_out_blocks[q_index])
            d_weights = einsum("bkgqh,bksh->bkgqs", d_out_blocks[q_index], v32)
            d_scores = weights * (d_weights - row_dot_blocks[q_index][..., None])
            if allowed is not None:
                d_scores = jnp.where(allowed, d_scores, 0.0)
            d_q = d_q.at[q_index].add(einsum("bkgqs,bksh->bkgqh", d_scores, k32))
            d_k = d_k + einsum("bkgqs,bkgqh->bksh", d_scores, q_blk)
            return (d_k, d_v, d_q), None

        zeros = jnp.zeros_like(k_blk, jnp.float32)
        (d_k, d_v, d_q), _ = jax.lax.scan(query_block, (zeros, zeros, d_q), jnp.arange(q_blocks.shape[0]))
        return d_q, (d_k, d_v)

    kv_blocks = _key_blocks(shape, kh, vh)
    d_q, (d_k, d_v) = jax.lax.scan(key_block, jnp.zeros_like(q_blocks, jnp.float32), kv_blocks)
    return (_unblocks(d_q, 3).astype(qh.dtype), _unblocks(d_k, 2).astype(kh.dtype), _unblocks(d_v, 2).astype(vh.dtype),
            d_rules)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    causal: bool = True,
    window: int | jax.Array | None = None,
    scale: float | None = None,
    precision: Any = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of ``q [B, T, N, H]`` over one layer of a `KVCache`; returns ``[B, T, N, H]``.

    The cache is in its own layout: keys ``k_cache [B * K, H, S]`` and values
    ``v_cache [B * K, S, H]`` (rows batch-major, then key/value head), with ``kv_positions [B, S]``
    the position each slot holds, negative where the slot is empty. The rules of
    `dot_product_attention` decide what a query sees (causal, window), by position rather than by
    slot. Both products read the cache where it lies, and scores and softmax are accumulated in
    float32 (or wider): the reference computation in the cache's layout, used whatever kernel the
    model names, since no fused kernel decodes from this layout. ``sinks [N]``: each head's sink
    logit (see `softmax_with_sinks`).

    Keys or values stored `Quantized` (`dew.nn.kv_quant`) are read as their codes, and each slot's
    scale multiplies what the product gives: a key's scale its score, a value's its softmax weight
    (the same sums as dequantizing first, without a dequantized copy of the cache). Queries are
    rotated by the Hadamard matrix the keys were stored under, if any.
    """
    q, (k_cache, k_scales), (v_cache, v_scales) = _cache_operands(q, k_cache, v_cache)  # scales [B * K, 1, S]
    batch, q_len, heads, head_dim = q.shape
    rows, slots = v_cache.shape[0], v_cache.shape[1]
    if rows % batch or k_cache.shape != (rows, head_dim, slots) or v_cache.shape[2] != head_dim:
        raise ValueError(
            f"for q {q.shape} the cache must hold keys [batch * kv_heads, {head_dim}, slots] and values "
            f"[batch * kv_heads, slots, {head_dim}]; got keys {k_cache.shape}, values {v_cache.shape}"
        )
    shape = _CacheShape.of(q, rows // batch, scale)
    logits = jnp.einsum("nqh,nhs->nqs", shape.rows(q, k_cache.dtype), k_cache, precision=precision,
                        preferred_element_type=shape.accumulate) * jnp.asarray(shape.scale, shape.accumulate)
    if k_scales is not None:
        logits = logits * k_scales
    weights = shape.weights(logits, q_positions, kv_positions, causal=causal, window=window, sinks=sinks)
    if v_scales is not None:
        weights = weights * v_scales
    out = jnp.einsum("nqs,nsh->nqh", weights.astype(v_cache.dtype), v_cache, precision=precision,
                     preferred_element_type=shape.accumulate)
    return shape.heads(out, q.dtype)


def paged_cache_attention(
    q: jax.Array,
    k_pool: Any,
    v_pool: Any,
    page_table: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    causal: bool = True,
    window: int | jax.Array | None = None,
    scale: float | None = None,
    precision: Any = None,
    sinks: jax.Array | None = None,
    shared: int = 0,
) -> jax.Array:
    """`cache_attention` read page by page from a paged cache's pools, where they lie.

    ``k_pool [P + 1, K, H, page]`` and ``v_pool [P + 1, K, page, H]`` hold every row's pages
    (`dew.nn.kv_pages`); ``page_table [B, E]`` names a row's pages and ``kv_positions [B, E * page]``
    the position of each of its slots. Every pool page is scored against the queries of the row
    whose table names it (each page's queries are gathered to it, not its keys to the row), the
    scores are laid out by row for the same masked softmax as `cache_attention`, and the weights go
    back to their pages for the value product; each row then sums its pages' parts. The pools are
    read once, in place, with no row-major copy of them: the work follows the pool, so this is the
    form for calls whose rows name most of it (decode steps of a Server).

    A page scored against one row's queries answers for that row only. Pages that several rows
    name (a prefix cache's shared prompt pages), up to ``shared`` of them, are scored against every
    row's queries instead, and each row takes the scores of the ones it names; with more such
    pages than ``shared`` the answer is wrong, so the caller counts them (`dew.nn.kv_pages`). What
    the scratch page (the pool's last) holds is never read.
    """
    q, (k_pool, k_scales), (v_pool, v_scales) = _cache_operands(q, k_pool, v_pool, paged=True)
    batch, q_len, heads, head_dim = q.shape
    pages, kv_heads, _, page_size = k_pool.shape
    entries = page_table.shape[1]
    if k_pool.shape[2] != head_dim or v_pool.shape != (pages, kv_heads, page_size, head_dim):
        raise ValueError(
            f"for q {q.shape} the pools must hold keys [pages, kv_heads, {head_dim}, page_size] and values "
            f"[pages, kv_heads, page_size, {head_dim}]; got keys {k_pool.shape}, values {v_pool.shape}"
        )
    shape = _CacheShape.of(q, kv_heads, scale)
    width = shape.groups * q_len
    scaling = jnp.asarray(shape.scale, shape.accumulate)
    row_queries = shape.rows(q, k_pool.dtype).reshape(batch, kv_heads, width, head_dim)
    owner = jnp.zeros((pages,), jnp.int32).at[page_table.reshape(-1)].set(
        jnp.repeat(jnp.arange(batch, dtype=jnp.int32), entries))
    logits = jnp.einsum("pkqh,pkhs->pkqs", row_queries[owner], k_pool, precision=precision,
                        preferred_element_type=shape.accumulate) * scaling  # [P + 1, K, G * T, page]
    if k_scales is not None:
        logits = logits * k_scales
    logits = logits[page_table]  # [B, E, K, G * T, page]
    if shared:  # pages several rows name: `common` ([M]), scored against every row
        named = jnp.zeros((pages,), jnp.int32).at[page_table.reshape(-1)].add(1).at[pages - 1].set(0)
        common = jnp.nonzero(named > 1, size=shared, fill_value=pages - 1)[0]
        several = (named > 1)[page_table]  # [B, E]: the entries that name one of them
        slot = jnp.zeros((pages,), jnp.int32).at[common].set(jnp.arange(shared, dtype=jnp.int32))[page_table]
        rows = jnp.arange(batch)[:, None]
        common_logits = jnp.einsum("bkqh,mkhs->mbkqs", row_queries, k_pool[common], precision=precision,
                                   preferred_element_type=shape.accumulate) * scaling  # [M, B, K, G * T, page]
        if k_scales is not None:
            common_logits = common_logits * k_scales[common][:, None]
        logits = jnp.where(several[:, :, None, None, None], common_logits[slot, rows], logits)
    # each row's pages end to end: [B * K, G * T, E * page]
    logits = logits.transpose(0, 2, 3, 1, 4).reshape(batch * kv_heads, width, entries * page_size)
    weights = shape.weights(logits, q_positions, kv_positions, causal=causal, window=window, sinks=sinks)
    weights = weights.reshape(batch, kv_heads, width, entries, page_size).transpose(0, 3, 1, 2, 4)
    own = weights if not shared else jnp.where(several[:, :, None, None, None], 0, weights)
    by_page = jnp.zeros((pages, kv_heads, width, page_size), weights.dtype).at[page_table].set(own)
    by_page = by_page.at[pages - 1].set(0)  # scratch, named by many rows: contributes nothing
    if v_scales is not None:
        by_page = by_page * v_scales
    out = jnp.einsum("pkqs,pksh->pkqh", by_page.astype(v_pool.dtype), v_pool, precision=precision,
                     preferred_element_type=shape.accumulate)
    out = out[page_table].sum(axis=1)  # [B, K, G * T, H]
    if shared:  # each row's weights on the common pages it names, back to those pages: [M, B, K, G * T, page]
        common_weights = jnp.zeros((shared, *weights.shape[:1], *weights.shape[2:]), weights.dtype)
        common_weights = common_weights.at[slot, rows].add(weights - own)
        if v_scales is not None:
            common_weights = common_weights * v_scales[common][:, None]
        out = out + jnp.einsum("mbkqs,mksh->bkqh", common_weights.astype(v_pool.dtype), v_pool[common],
                               precision=precision, preferred_element_type=shape.accumulate)
    return shape.heads(out.reshape(batch * kv_heads, width, head_dim), q.dtype)


def _cache_operands(q, k, v, *, paged: bool = False):
    """Queries (rotated when the keys are) and the keys' and values' arrays with their scales laid
    along the slots as a score row needs them (None when not quantized): a dense cache's
    ``[B * K, 1, S]``, a pool's ``[P + 1, K, 1, page]``."""
    k_scales = v_scales = None
    if isinstance(k, Quantized):
        q = rotate(q) if k.rotated else q
        k, k_scales = k.codes.astype(q.dtype), k.scales  # keys hold head_dim before the slots
    if isinstance(v, Quantized):
        v, v_scales = v.codes.astype(q.dtype), jnp.swapaxes(v.scales, -1, -2)
    return q, (k, k_scales), (v, v_scales)


@dataclasses.dataclass(frozen=True)
class _CacheShape:
    """The head arrangement a cache's attention works in: each of the B * K cache rows (a row's
    key/value head) with the G * T queries that read it."""

    batch: int
    q_len: int
    kv_heads: int
    groups: int
    head_dim: int
    scale: float
    accumulate: Any

    @classmethod
    def of(cls, q: jax.Array, kv_heads: int, scale: float | None) -> "_CacheShape":
        batch, q_len, heads, head_dim = q.shape
        if heads % kv_heads:
            raise ValueError(f"num_heads ({heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
        scale = float(1.0 / np.sqrt(head_dim)) if scale is None else float(scale)
        return cls(batch, q_len, kv_heads, heads // kv_heads, head_dim, scale, jnp.promote_types(q.dtype, jnp.float32))

    def rows(self, q: jax.Array, dtype: Any) -> jax.Array:
        """``q [B, T, K * G, H]`` -> ``[B * K, G * T, H]``: each cache row's queries."""
        qr = q.reshape(self.batch, self.q_len, self.kv_heads, self.groups, self.head_dim).transpose(0, 2, 3, 1, 4)
        return qr.reshape(self.batch * self.kv_heads, self.groups * self.q_len, self.head_dim).astype(dtype)

    def heads(self, out: jax.Array, dtype: Any) -> jax.Array:
        """``[B * K, G * T, H]`` -> ``[B, T, K * G, H]``."""
        out = out.reshape(self.batch, self.kv_heads, self.groups, self.q_len, self.head_dim).transpose(0, 3, 1, 2, 4)
        return out.reshape(self.batch, self.q_len, self.kv_heads * self.groups, self.head_dim).astype(dtype)

    def weights(self, logits, q_positions, kv_positions, *, causal, window, sinks) -> jax.Array:
        """Softmax weights of scaled scores ``[B * K, G * T, S]``: what each query may see by position
        (causal, window, empty slots), with the heads' sink logits."""
        slots = logits.shape[-1]
        mask = attention_mask(q_positions, kv_positions, causal=causal, window=window)  # [B, 1, T, S]
        mask = mask & (jnp.atleast_2d(kv_positions) >= 0)[:, None, None, :]
        mask = jnp.broadcast_to(mask[:, None], (self.batch, self.kv_heads, self.groups, self.q_len, slots))
        rows = self.batch * self.kv_heads
        logits = jnp.where(mask.reshape(rows, self.groups * self.q_len, slots), logits,
                           jnp.finfo(self.accumulate).min)
        sinks = _check_sinks(sinks, self.kv_heads * self.groups)
        row_sinks = None
        if sinks is not None:  # [N] -> [B * K, G * T], one per cache row's query row
            row_sinks = jnp.repeat(sinks.astype(self.accumulate).reshape(self.kv_heads, self.groups), self.q_len, axis=1)
            row_sinks = jnp.tile(row_sinks, (self.batch, 1))
        return softmax_with_sinks(logits, row_sinks)
