"""CausalTransformer: causality, KV cache, sliding windows, segments, RoPE, scan/remat, names."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones.causal_transformer import CausalTransformer, check_tokens
from dew.nn.backbones.layer_plan import LayerKind, resolve_layer_plan
from dew.nn.rope import apply_rope, rope_cos_sin, rope_frequencies

VOCAB = 61


def _model(**overrides):
    settings = dict(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_features=64, max_seq_len=24, attention_impl="xla")
    settings.update(overrides)
    return CausalTransformer(**settings)


def _tokens(batch=2, length=12, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


def _init(model, tokens=None, seed=0):
    tokens = _tokens() if tokens is None else tokens
    return nn.unbox(jax.jit(model.init)(jax.random.key(seed), tokens))


_COMPILED = {}


def _run(model, variables, tokens, **kwargs):
    """model.apply under one jit per model (eager Flax dispatch is slow on a loaded CPU)."""
    if model not in _COMPILED:
        _COMPILED[model] = jax.jit(lambda v, t, **kw: model.apply(v, t, **kw))
    return _COMPILED[model](variables, tokens, **kwargs)


@pytest.fixture(scope="module")
def base():
    model = _model()
    return model, _init(model)


def test_changing_the_tail_leaves_every_earlier_logit_bit_identical(base):
    model, variables = base
    tokens = _tokens()
    changed = tokens.copy()
    changed[:, 7:] = (changed[:, 7:] + 5) % VOCAB
    a, b = _run(model, variables, tokens), _run(model, variables, changed)
    assert a.dtype == jnp.float32 and a.shape == (2, 12, VOCAB)
    np.testing.assert_array_equal(np.asarray(a)[:, :7], np.asarray(b)[:, :7])
    assert np.abs(np.asarray(a)[:, 7:] - np.asarray(b)[:, 7:]).max() > 1e-4


@pytest.mark.parametrize("scan_layers", [False, True])
def test_cached_decoding_matches_a_full_forward_pass(base, scan_layers):
    model = _model(scan_layers=scan_layers, layer_types=("sliding_attention", "full_attention"),
                   kinds={"sliding_attention": LayerKind(window=4)})
    tokens = _tokens()
    variables = _init(_model())  # a window changes no parameter
    if scan_layers:
        variables = {"params": _restack(variables["params"], 2)}
    full = np.asarray(_run(model, variables, tokens))
    cache = model.init_cache(2, 16)
    logits, cache = _run(model, variables, tokens[:, :5], cache=cache)
    pieces = [np.asarray(logits)]
    for t in range(5, 12):
        logits, cache = _run(model, variables, tokens[:, t:t + 1], cache=cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])


@pytest.mark.parametrize("tie", [True, False])
def test_logits_at_computes_the_named_tokens_logits_and_leaves_the_cache_as_it_was(tie):
    model = _model(tie_embeddings=tie)
    variables = _init(model)
    tokens = _tokens()
    at = np.array([[11, 3], [0, 7]], np.int32)
    full = np.asarray(_run(model, variables, tokens))
    some = np.asarray(_run(model, variables, tokens, logits_at=at))
    assert some.shape == (2, 2, VOCAB)
    np.testing.assert_allclose(some, np.take_along_axis(full, at[..., None], axis=1), atol=1e-5, rtol=1e-5)
    assert np.abs(some[:, ::-1] - np.take_along_axis(full, at[..., None], axis=1)).max() > 1e-3  # the control
    whole, whole_cache = _run(model, variables, tokens, cache=model.init_cache(2, 16))
    last, last_cache = _run(model, variables, tokens, cache=model.init_cache(2, 16), logits_at=at[:, :1])
    np.testing.assert_allclose(np.asarray(last)[:, 0], np.asarray(whole)[[0, 1], [11, 0]], atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(whole_cache), jax.tree.leaves(last_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"logits_at must be integer indices \[batch=2, K\]"):
        model.apply(variables, tokens, logits_at=np.array([11, 0]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 12\)"):
        model.apply(variables, tokens, logits_at=np.array([[12], [0]]))


def test_the_cache_holds_per_layer_keys_and_values_in_shared_slots():
    model = _model()
    cache = model.init_cache(3, 10)
    assert len(cache.k) == len(cache.v) == 2
    # keys [batch * kv_heads, head_dim, slots], values [batch * kv_heads, slots, head_dim]: the
    # operand layouts of the attention products
    assert cache.k[0].shape == (3 * 2, 8, 10) and cache.v[0].shape == (3 * 2, 10, 8)
    assert cache.kv_heads == 2 and cache.max_len == 10
    assert cache.positions.shape == (3, 10) and (np.asarray(cache.positions) == -1).all()
    assert cache.lengths.shape == (3,) and int(cache.index) == 0
    scanned = _model(scan_layers=True).init_cache(3, 10)
    assert scanned.k.shape == (2, 3 * 2, 8, 10) and scanned.v.shape == (2, 3 * 2, 10, 8)
    assert scanned.kv_heads == 2


@pytest.mark.parametrize("scan_layers", [False, True])
def test_rows_of_different_lengths_decode_from_shared_slots(base, scan_layers):
    """A padded prefill truncated to each row's length, then one shared slot per step.

    Row 0's prompt has 7 tokens and row 1's 4, both prefilled padded to 7; after `truncate` each
    row continues at its own position while both write the same slots. Every step must match a
    full forward pass over that row's real tokens alone.
    """
    _, variables = base
    model = _model(scan_layers=scan_layers, layer_types=("sliding_attention", "full_attention"),
                   kinds={"sliding_attention": LayerKind(window=3)})
    if scan_layers:
        variables = {"params": _restack(variables["params"], 2)}
    tokens = _tokens(length=12)
    lengths = np.array([7, 4], np.int32)
    cache = model.init_cache(2, 16)
    padded = tokens[:, :7].copy()
    padded[1, 4:] = 0  # padding after the short prompt
    _, cache = _run(model, variables, padded, cache=cache)
    cache = cache.truncate(lengths)
    np.testing.assert_array_equal(np.asarray(cache.positions)[:, :8],
                                  [[0, 1, 2, 3, 4, 5, 6, -1], [0, 1, 2, 3, -1, -1, -1, -1]])
    for step in range(3):
        fed = np.stack([tokens[0, 7 + step], tokens[1, 4 + step]])[:, None]
        logits, cache = _run(model, variables, fed, cache=cache)
        assert int(cache.index) == 8 + step  # one shared slot per step
        for row, length in enumerate(lengths):
            alone = tokens[row:row + 1, :length + step + 1]
            full = np.asarray(_run(model, variables, alone))[0, -1]
            np.testing.assert_allclose(np.asarray(logits)[row, 0], full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 3)

    # negative control: without truncating, the short row attends to its padding and is caught
    stale = model.init_cache(2, 16)
    _, stale = _run(model, variables, padded, cache=stale)
    stale = stale.replace(lengths=jnp.asarray(lengths))
    fed = np.stack([tokens[0, 7], tokens[1, 4]])[:, None]
    logits, _ = _run(model, variables, fed, cache=stale)
    full = np.asarray(_run(model, variables, tokens[1:, :5]))[0, -1]
    assert np.abs(np.asarray(logits)[1, 0] - full).max() > 1e-3


def test_a_cache_that_cannot_take_the_tokens_is_refused(base):
    model, variables = base
    cache = model.init_cache(2, 8)
    _, cache = _run(model, variables, _tokens(length=6), cache=cache)
    with pytest.raises(ValueError, match="2 free slots of 8 and cannot take 3 more tokens"):
        model.apply(variables, _tokens(length=3), cache=cache)
    with pytest.raises(ValueError, match="holds 2 rows but the tokens have 3"):
        model.apply(variables, _tokens(batch=3, length=1), cache=cache)


def test_repeating_a_cache_repeats_each_row_in_place(base):
    model, variables = base
    cache = model.init_cache(2, 16)
    tokens = _tokens()
    _, cache = _run(model, variables, tokens[:, :5], cache=cache)
    repeated = cache.repeat(3)
    assert repeated.k[0].shape == (2 * 3 * 2, 8, 16) and repeated.batch_size == 6
    logits, _ = _run(model, variables, np.repeat(tokens[:, 5:6], 3, axis=0), cache=repeated)
    full = np.asarray(_run(model, variables, tokens[:, :6]))[:, -1]
    np.testing.assert_allclose(np.asarray(logits)[:, 0], np.repeat(full, 3, axis=0), atol=1e-5, rtol=1e-5)


def test_two_window_3_layers_move_exactly_the_receptive_field(base):
    model = _model(layer_types=("sliding_attention",) * 2, kinds={"sliding_attention": LayerKind(window=3)})
    tokens = _tokens(batch=1, length=20)
    variables = base[1]
    changed = tokens.copy()
    changed[0, 6] = (changed[0, 6] + 1) % VOCAB
    delta = np.abs(np.asarray(_run(model, variables, tokens)) - np.asarray(_run(model, variables, changed)))
    moved = delta.max(axis=-1)[0] > 0
    # layer 1 carries token 6 to positions 6..8, layer 2 carries those to 6..10
    np.testing.assert_array_equal(np.flatnonzero(moved), np.arange(6, 11))


def test_full_attention_layers_reach_every_later_position(base):
    model, variables = base
    tokens = _tokens(batch=1)
    changed = tokens.copy()
    changed[0, 3] = (changed[0, 3] + 1) % VOCAB
    delta = np.abs(np.asarray(_run(model, variables, tokens)) - np.asarray(_run(model, variables, changed)))
    np.testing.assert_array_equal(np.flatnonzero(delta.max(axis=-1)[0] > 0), np.arange(3, 12))


def test_segment_ids_keep_packed_documents_apart(base):
    model, variables = base
    first, second = _tokens(batch=1, length=5, seed=1), _tokens(batch=1, length=7, seed=2)
    packed = np.concatenate([first, second], axis=1)
    segments = np.array([[0] * 5 + [1] * 7])
    positions = np.array([list(range(5)) + list(range(7))])
    logits = np.asarray(_run(model, variables, packed, positions=positions, segment_ids=segments))
    np.testing.assert_allclose(logits[:, :5], np.asarray(_run(model, variables, first)), atol=1e-5)
    np.testing.assert_allclose(logits[:, 5:], np.asarray(_run(model, variables, second)), atol=1e-5)
    leaky = np.asarray(_run(model, variables, packed, positions=positions))  # no segment ids
    assert np.abs(leaky[:, 5:] - np.asarray(_run(model, variables, second))).max() > 1e-4


def test_causal_false_is_bidirectional(base):
    model, variables = _model(causal=False), base[1]
    tokens = _tokens()
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    delta = np.abs(np.asarray(_run(model, variables, tokens)) - np.asarray(_run(model, variables, changed)))
    assert delta[:, 0].max() > 1e-5


# --- RoPE against a NumPy transcription of transformers' modeling_rope_utils ----------------------


def _hf_inv_freq(dim, base, scaling, max_position_embeddings):
    """transformers' _compute_*_parameters, line for line in NumPy (float32 like torch)."""
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2).astype(np.float32) / dim))
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low_ff, high_ff = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old / low_ff, old / high_ff
        wavelen = 2 * math.pi / inv_freq
        out = np.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return np.where(medium, smoothed, out), 1.0
    assert kind == "yarn"
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(s, m=1):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
            else get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = math.floor(corr(beta_fast)), math.ceil(corr(beta_slow))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    pos = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra, attention


ROPE_CASES = {
    "default": (64, 10000.0, None),
    "linear": (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    "linear-old-key": (32, 10000.0, {"type": "linear", "factor": 2.0}),
    "llama3": (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (128, 1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-mscale": (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                  "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(case):
    dim, theta, scaling = ROPE_CASES[case]
    got, got_factor = rope_frequencies(dim, theta, scaling, max_position_embeddings=131072)
    want, want_factor = _hf_inv_freq(dim, theta, scaling, 131072)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    # negative control: the same recipe with the wrong theta is far off
    wrong, _ = _hf_inv_freq(dim, theta * 2, scaling, 131072)
    assert np.abs(got / wrong - 1).max() > 1e-2


def test_scaled_rope_really_changes_the_low_frequencies():
    plain, _ = rope_frequencies(128, 500000.0)
    llama3, _ = rope_frequencies(128, 500000.0, ROPE_CASES["llama3"][2])
    assert llama3[0] == plain[0] and llama3[-1] == pytest.approx(plain[-1] / 8, rel=1e-6)


def test_rotation_uses_rotate_half_and_matches_hf():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
    positions = np.arange(5)[None]
    inv_freq, factor = rope_frequencies(8, 10000.0)
    cos, sin = rope_cos_sin(jnp.asarray(positions), inv_freq, factor)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    freqs = positions[..., None].astype(np.float32) * inv_freq  # [1, 5, 4]
    emb = np.concatenate([freqs, freqs], -1)[:, :, None, :]
    half = np.concatenate([-x[..., 4:], x[..., :4]], -1)
    np.testing.assert_allclose(got, x * np.cos(emb) + half * np.sin(emb), atol=1e-6)
    # negative control: an interleaved rotation is a different function
    inter = np.stack([-x[..., 1::2], x[..., 0::2]], -1).reshape(x.shape)
    assert np.abs(got - (x * np.cos(emb) + inter * np.sin(emb))).max() > 1e-2


def test_rope_theta_reaches_the_logits(base):
    model, variables = base
    tokens = _tokens()
    other = model.clone(rope_theta=500.0)
    assert np.abs(np.asarray(_run(other, variables, tokens)) - np.asarray(_run(model, variables, tokens))).max() > 1e-5


# --- scan, remat, kernels, names ------------------------------------------------------------------


def _restack(params, num_layers):
    stacked = {k: v for k, v in params.items() if not k.startswith("layers_")}
    stacked["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"]
                                                                           for i in range(num_layers)])
    return stacked


@pytest.mark.parametrize("layer_types", [None, ("sliding_attention", "full_attention")])
def test_scan_layers_gives_the_same_logits_as_unscanned(base, layer_types):
    kinds = {"sliding_attention": LayerKind(window=3)}
    model = _model(layer_types=layer_types, kinds=kinds)
    tokens = _tokens()
    variables = base[1]
    scanned = model.clone(scan_layers=True)
    params = _restack(variables["params"], 2)
    shapes = nn.unbox(jax.eval_shape(scanned.init, jax.random.key(0), tokens))["params"]
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), params) == jax.tree_util.tree_map(
        lambda x: (x.shape, x.dtype), shapes)
    np.testing.assert_allclose(np.asarray(_run(scanned, {"params": params}, tokens)),
                               np.asarray(_run(model, variables, tokens)), atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "minimal", "save_qkv_proj"])
def test_remat_changes_neither_values_nor_gradients(base, policy):
    model, variables = base
    tokens = _tokens()
    remat = model.clone(remat=policy)

    def loss(params, m):
        return jnp.mean(m.apply({"params": params}, tokens) ** 2)

    loss_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    if ("grad", model) not in _COMPILED:
        _COMPILED[("grad", model)] = loss_and_grad(variables["params"], model)
    v1, g1 = _COMPILED[("grad", model)]
    v2, g2 = loss_and_grad(variables["params"], remat)
    np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_the_kernel_choice_never_changes_parameters(base):
    model, variables = base
    tokens = _tokens()
    reference = model.clone(attention_impl="reference")
    shapes = lambda m: jax.tree_util.tree_map(  # noqa: E731
        lambda x: (x.shape, x.dtype), nn.unbox(jax.eval_shape(m.init, jax.random.key(0), tokens)))
    assert shapes(reference) == shapes(model)
    np.testing.assert_allclose(np.asarray(_run(reference, variables, tokens)),
                               np.asarray(_run(model, variables, tokens)), atol=1e-5)


def _paths(tree):
    return {"/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def test_parameter_names_follow_the_hf_llama_layout(base):
    _, variables = base
    layer = {"input_layernorm/scale", "post_attention_layernorm/scale", "self_attn/q_norm/scale",
             "self_attn/k_norm/scale", "mlp/gate_proj/kernel", "mlp/up_proj/kernel", "mlp/down_proj/kernel"}
    layer |= {f"self_attn/{p}_proj/kernel" for p in "qkvo"}
    want = {"embed_tokens/embedding", "norm/scale"} | {f"layers_{i}/{p}" for i in range(2) for p in layer}
    assert _paths(variables["params"]) == want
    q = variables["params"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    k = variables["params"]["layers_0"]["self_attn"]["k_proj"]["kernel"]
    assert q.shape == (32, 32) and k.shape == (32, 16)

    untied = nn.unbox(jax.eval_shape(_model(tie_embeddings=False, qk_norm=False, attention_bias=True, mlp_bias=True).init,
                            jax.random.key(0), _tokens()))
    paths = _paths(untied["params"])
    assert "lm_head/kernel" in paths and "layers_0/self_attn/q_norm/scale" not in paths
    assert {"layers_0/self_attn/q_proj/bias", "layers_0/self_attn/o_proj/bias", "layers_0/mlp/up_proj/bias",
            "layers_0/mlp/down_proj/bias"} <= paths


def test_every_parameter_carries_logical_axis_names():
    model = _model(tie_embeddings=False, attention_bias=True, mlp_bias=True)
    boxed = jax.eval_shape(model.init, jax.random.key(0), _tokens())["params"]
    specs = nn.get_partition_spec(boxed)
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    attn = specs["layers_0"]["self_attn"]
    assert tuple(specs["embed_tokens"]["embedding"]) == ("vocab", "embed")
    assert tuple(attn["q_proj"]["kernel"]) == ("embed", "heads")
    assert tuple(attn["k_proj"]["kernel"]) == ("embed", "kv_heads")
    assert tuple(attn["v_proj"]["kernel"]) == ("embed", "kv_heads")
    assert tuple(attn["o_proj"]["kernel"]) == ("heads", "embed")
    assert tuple(attn["q_proj"]["bias"]) == ("heads",) and tuple(attn["k_proj"]["bias"]) == ("kv_heads",)
    assert tuple(attn["o_proj"]["bias"]) == ("embed",) and tuple(attn["q_norm"]["scale"]) == ("norm",)
    mlp = specs["layers_0"]["mlp"]
    assert tuple(mlp["gate_proj"]["kernel"]) == ("embed", "mlp") and tuple(mlp["down_proj"]["kernel"]) == ("mlp", "embed")
    assert tuple(mlp["up_proj"]["bias"]) == ("mlp",)
    assert tuple(specs["lm_head"]["kernel"]) == ("embed", "vocab") and tuple(specs["norm"]["scale"]) == ("norm",)
    scanned = nn.get_partition_spec(jax.eval_shape(model.clone(scan_layers=True).init, jax.random.key(0),
                                                         _tokens())["params"])
    assert tuple(scanned["layers"]["self_attn"]["q_proj"]["kernel"]) == ("layers", "embed", "heads")


def test_rmsnorm_uses_hf_formula(base):
    from dew.nn.backbones.causal_transformer import RMSNorm

    x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32)
    norm = RMSNorm(eps=1e-6)
    scale = np.linspace(0.5, 1.5, 16).astype(np.float32)
    got = np.asarray(norm.apply({"params": {"scale": scale}}, x))
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_dtype_is_compute_and_param_dtype_is_storage(base):
    model = _model(dtype=jnp.bfloat16)
    shapes = jax.eval_shape(model.init, jax.random.key(0), _tokens())
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(nn.unbox(shapes)))
    logits = _run(model, base[1], _tokens())
    assert logits.dtype == jnp.float32
    full = np.asarray(_run(base[0], base[1], _tokens()))
    error = float(np.abs(np.asarray(logits) - full).max())
    # computed in bfloat16: not the float32 result, but within a few of bfloat16's 8-bit steps of it
    # (another init's logits differ by ~0.5, two orders of magnitude more)
    assert 1e-5 < error < 4 * 2.0**-8 * np.abs(full).max(), error
    stored = nn.unbox(jax.eval_shape(_model(param_dtype=jnp.bfloat16).init, jax.random.key(0), _tokens()))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(stored))


def test_layer_plan_resolves_types_and_kinds():
    plan = resolve_layer_plan(3, ("sliding_attention", "full_attention", "local"),
                              {"sliding_attention": LayerKind(window=4), "local": LayerKind(window=2, rope_theta=1e4)})
    assert [k.window for k in plan] == [4, None, 2] and plan[2].rope_theta == 1e4
    assert resolve_layer_plan(2) == (LayerKind(), LayerKind())


def test_bad_configurations_and_inputs_raise_clear_errors(base):
    model, variables = base
    with pytest.raises(ValueError, match="longer than max_seq_len=24"):
        model.apply(variables, _tokens(length=25))
    with pytest.raises(ValueError, match="not divisible by num_kv_heads=3"):
        _model(num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown layer type 'global'.*full_attention"):
        _model(layer_types=("global", "full_attention"))
    with pytest.raises(ValueError, match="needs a window|no window"):
        _model(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="one name per layer"):
        _model(layer_types=("full_attention",))
    with pytest.raises(ValueError, match="'auto', 'reference', 'xla', 'cudnn'"):
        _model(attention_impl="flash")
    with pytest.raises(ValueError, match="'full', 'minimal', 'save_qkv_proj'"):
        _model(remat="everything")
    with pytest.raises(ValueError, match="rope_scaling type 'dynamo'"):
        _model(rope_scaling={"rope_type": "dynamo", "factor": 2.0})
    with pytest.raises(ValueError, match="LayerKind.window"):
        LayerKind(window=0)
    bad = _tokens()
    bad[1, 4] = VOCAB
    with pytest.raises(ValueError, match=f"token id {VOCAB} at index \\(1, 4\\).*vocab_size={VOCAB}"):
        model.apply(variables, bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_tokens(np.array([[-1]]), VOCAB)
    check_tokens(np.array([[0, VOCAB - 1]]), VOCAB)  # in range: no error
