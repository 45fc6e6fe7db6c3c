"""The CPU decode layout: DecodeTransformer over rearranged weights against CausalTransformer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import ScopeParamNotFoundError

from dew.inference import decode_layout as layout_module
from dew.inference.decode_layout import (
    DecodeTransformer,
    DecodeWeights,
    decode_layout,
    for_decoding,
    uses_decode_layout,
)
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.sampling import Sampling, generate

VOCAB = 61


def _model(**overrides):
    """GQA, q/k norm, biases, a sliding-window layer then a full one; projections of every shape:
    q/k/v [32 -> 64] and gate/up [32 -> 96] widen, o [32 -> 32] is square, down [48 -> 32] narrows."""
    settings = dict(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_features=48, max_seq_len=24, qk_norm=True, attention_bias=True, mlp_bias=True,
                    attention_impl="xla", layer_types=("sliding_attention", "full_attention"),
                    kinds={"sliding_attention": LayerKind(window=4)})
    settings.update(overrides)
    return CausalTransformer(**settings)


def _tokens(batch=2, length=12, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


def _variables(model, seed=0):
    """Initialized variables with every leaf moved off its init (biases start at zero, norms at
    one), so a bias or norm scale that went to the wrong place shows."""
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(seed), _tokens()))
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    noise = np.random.default_rng(seed + 3)
    return jax.tree_util.tree_unflatten(
        treedef, [x + 0.05 * noise.standard_normal(x.shape).astype(np.float32) for x in leaves])


_COMPILED = {}


def _run(model, variables, tokens, **kwargs):
    """model.apply under one jit per model."""
    if model not in _COMPILED:
        _COMPILED[model] = jax.jit(lambda v, t, **kw: model.apply(v, t, **kw))
    return _COMPILED[model](variables, tokens, **kwargs)


@pytest.fixture(scope="module", params=[False, True], ids=["layers", "scan_layers"])
def pair(request):
    """(model, variables, decode model, decode variables), unscanned and scanned."""
    model = _model(scan_layers=request.param)
    variables = _variables(model)
    return (model, variables, *decode_layout(model, variables))


def _layer(params, model):
    return params["layers" if model.scan_layers else "layers_0"]


def _with_layer(variables, model, **changes):
    """`variables` with entries of the first layer's (or the stacked layers') params replaced."""
    name = "layers" if model.scan_layers else "layers_0"
    layer = dict(variables["params"][name])
    for part, projections in changes.items():
        layer[part] = {**layer[part], **projections}
    return {**variables, "params": {**variables["params"], name: layer}}


def test_the_decode_layout_computes_the_same_function(pair):
    model, variables, decoder, converted = pair
    assert type(decoder) is DecodeTransformer and decoder.scan_layers == model.scan_layers
    tokens = _tokens()
    full = np.asarray(_run(model, variables, tokens))
    np.testing.assert_allclose(np.asarray(_run(decoder, converted, tokens)), full, atol=1e-5, rtol=1e-5)

    # cached decoding from the decode layout: a 5-token prefill, then one token at a time
    cache = decoder.init_cache(2, 16)
    logits, cache = _run(decoder, converted, tokens[:, :5], cache=cache)
    pieces = [np.asarray(logits)]
    for t in range(5, 12):
        logits, cache = _run(decoder, converted, tokens[:, t:t + 1], cache=cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)


def test_the_conversion_writes_exactly_the_parameters_the_decode_model_reads(pair):
    model, variables, decoder, converted = pair
    wanted = nn.unbox(jax.eval_shape(decoder.init, jax.random.key(0), _tokens()))
    shapes = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert shapes(converted) == shapes(wanted)

    layer, original = _layer(converted["params"], model), _layer(variables["params"], model)
    assert set(layer["self_attn"]) == {"qkv_proj", "o_proj", "q_norm", "k_norm"}
    assert set(layer["mlp"]) == {"gate_up_proj", "down_proj"}
    qkv = np.concatenate([original["self_attn"][p]["kernel"] for p in ("q_proj", "k_proj", "v_proj")], -1)
    np.testing.assert_array_equal(np.asarray(layer["self_attn"]["qkv_proj"]["kernel_t"]), np.swapaxes(qkv, -1, -2))
    np.testing.assert_array_equal(np.asarray(layer["mlp"]["down_proj"]["kernel_t"]),
                                  np.swapaxes(np.asarray(original["mlp"]["down_proj"]["kernel"]), -1, -2))
    # the embedding is shared, not copied; the source variables keep their layout
    assert converted["params"]["embed_tokens"]["embedding"] is variables["params"]["embed_tokens"]["embedding"]
    assert "q_proj" in original["self_attn"] and "kernel" in original["mlp"]["down_proj"]


@pytest.mark.parametrize("broken", ["gate_up_halves_swapped", "k_v_swapped", "o_untransposed",
                                    "k_v_bias_swapped"])
def test_a_misplaced_block_of_a_converted_kernel_is_caught(pair, broken):
    """Negative controls: the comparison above fails for each way the conversion could go wrong."""
    model, variables, decoder, converted = pair
    layer = _layer(converted["params"], model)
    attention, mlp = layer["self_attn"], layer["mlp"]
    q = model.num_heads * model.head_features
    kv = model.kv_heads * model.head_features
    if broken == "gate_up_halves_swapped":  # a widening product, computed as x @ kernel_t.T
        gate_up = mlp["gate_up_proj"]
        swapped = jnp.concatenate(jnp.split(gate_up["kernel_t"], 2, axis=-2)[::-1], axis=-2)
        changed = _with_layer(converted, model, mlp={"gate_up_proj": {**gate_up, "kernel_t": swapped}})
    elif broken == "k_v_swapped":
        qkv = attention["qkv_proj"]
        q_rows, k_rows, v_rows = jnp.split(qkv["kernel_t"], [q, q + kv], axis=-2)
        swapped = jnp.concatenate([q_rows, v_rows, k_rows], axis=-2)
        changed = _with_layer(converted, model, self_attn={"qkv_proj": {**qkv, "kernel_t": swapped}})
    elif broken == "o_untransposed":  # a square kernel: the shapes cannot tell
        o = attention["o_proj"]
        changed = _with_layer(converted, model,
                              self_attn={"o_proj": {**o, "kernel_t": jnp.swapaxes(o["kernel_t"], -1, -2)}})
    else:
        qkv = attention["qkv_proj"]
        q_bias, k_bias, v_bias = jnp.split(qkv["bias"], [q, q + kv], axis=-1)
        swapped = jnp.concatenate([q_bias, v_bias, k_bias], axis=-1)
        changed = _with_layer(converted, model, self_attn={"qkv_proj": {**qkv, "bias": swapped}})
    tokens = _tokens()
    full = np.asarray(_run(model, variables, tokens))
    assert np.abs(np.asarray(_run(decoder, changed, tokens)) - full).max() > 1e-3


def test_the_model_itself_reads_only_its_one_layout(pair):
    model, _, _, converted = pair
    with pytest.raises(ScopeParamNotFoundError, match="q_proj|kernel"):
        _run(model, converted, _tokens())


def test_variables_of_another_layout_are_refused_with_the_projection_named():
    model = _model(attention_bias=False, mlp_bias=False)
    variables = _variables(model)
    params = variables["params"]
    odd = {**params, "layers_1": {**params["layers_1"], "mlp": {**params["layers_1"]["mlp"],
                                                                 "down_proj": {"w": jnp.zeros((48, 32))}}}}
    with pytest.raises(ValueError, match="layers_1/mlp/down_proj holds"):
        decode_layout(model, {"params": odd})
    with pytest.raises(TypeError, match="converts a CausalTransformer"):
        decode_layout(nn.Dense(3), variables)


def test_for_decoding_converts_the_layout_rows_on_cpu_and_passes_everything_else_through(monkeypatch):
    model = _model()
    variables = _variables(model)
    for rows in (1, 3, 8, 48):
        decoder, converted = for_decoding(model, variables, rows)
        assert type(decoder) is DecodeTransformer and "qkv_proj" in converted["params"]["layers_0"]["self_attn"]
    for rows in (2, 49, 64):  # these decode as fast or faster from the weights as trained
        got_model, got_variables = for_decoding(model, variables, rows)
        assert got_model is model and got_variables is variables
    assert for_decoding(decoder, converted, 1)[1] is converted  # already converted: as given
    dense = nn.Dense(3)
    assert for_decoding(dense, variables, 1)[0] is dense  # not a CausalTransformer

    seen = []

    @jax.jit
    def traced(v):
        seen.append(for_decoding(model, v, 1)[0])
        return v["params"]["embed_tokens"]["embedding"]

    traced(variables)
    assert seen == [model]  # traced weights: converting would redo the copy on every call
    with pytest.raises(ValueError, match="rows must be a positive integer"):
        for_decoding(model, variables, 0)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not uses_decode_layout(model, variables, 1)
    assert for_decoding(model, variables, 1)[1] is variables


def test_decode_weights_convert_once_per_weights_and_compile_once_per_model(monkeypatch):
    model = _model(num_layers=3, layer_types=None, kinds=None)  # shapes no other test converts
    first, second = _variables(model, seed=1), _variables(model, seed=2)
    traced = []
    decode_block = layout_module._decode_block
    monkeypatch.setattr(layout_module, "_decode_block",
                        lambda block, where: traced.append(where) or decode_block(block, where))

    weights = DecodeWeights(model, first)
    decoder, converted = weights.get(1)
    assert weights.get(1)[1] is converted  # kept, not redone
    assert weights.get(2)[0] is model and weights.get(2)[1] is first
    assert weights.get(16)[1] is converted  # one copy for every row count that reads the layout
    other_decoder, other = DecodeWeights(model, second).get(1)
    assert other_decoder == decoder and hash(other_decoder) == hash(decoder)  # generate's jit reuses it
    assert traced == ["layers_0", "layers_1", "layers_2"]  # traced once, for both weights
    np.testing.assert_array_equal(
        np.asarray(other["params"]["layers_2"]["mlp"]["down_proj"]["kernel_t"]),
        np.asarray(second["params"]["layers_2"]["mlp"]["down_proj"]["kernel"]).T)


def test_one_row_generates_from_the_decode_layout_what_the_model_generates():
    model = _model(max_seq_len=32)
    variables = _variables(model)
    greedy = Sampling(temperature=0.0)
    prompt = [[7, 1, 4, 4, 8, 3, 12]]
    want = generate(model, variables, prompt, 8, key=jax.random.key(0), sampling=greedy).host()
    decoder, converted = DecodeWeights(model, variables).get(1)
    assert type(decoder) is DecodeTransformer
    got = generate(decoder, converted, prompt, 8, key=jax.random.key(0), sampling=greedy).host()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.raw_log_probs, want.raw_log_probs, atol=1e-5)
    # and those tokens are what repeated full forward passes of the model choose
    sequence = list(prompt[0])
    for t in range(8):
        padded = np.zeros((1, 16), np.int32)  # one compile for every length; the padding comes after
        padded[0, :len(sequence)] = sequence
        logits = np.asarray(_run(model, variables, padded))[0, len(sequence) - 1]
        sequence.append(int(np.argmax(logits)))
        assert int(got.tokens[0, t]) == sequence[-1]


def test_a_batch_generates_from_the_decode_layout_what_the_model_generates():
    model = _model(max_seq_len=32)
    variables = _variables(model)
    sampled = Sampling(temperature=0.8, top_k=20)
    prompts = [[7, 1, 4, 4, 8, 3, 12], [5, 9], [2, 2, 6, 11]]
    want = generate(model, variables, prompts, 8, key=jax.random.key(3), sampling=sampled).host()
    decoder, converted = DecodeWeights(model, variables).get(len(prompts))
    assert type(decoder) is DecodeTransformer
    got = generate(decoder, converted, prompts, 8, key=jax.random.key(3), sampling=sampled).host()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.raw_log_probs, want.raw_log_probs, atol=1e-5)
    # a control: with gate and up swapped in one layer's layout the log-probabilities move far past
    # the tolerance (this small model's tokens may stay the same)
    mlp = converted["params"]["layers_0"]["mlp"]["gate_up_proj"]
    swapped = {name: jnp.concatenate(jnp.split(value, 2, axis=0)[::-1], axis=0) for name, value in mlp.items()}
    wrong = jax.tree_util.tree_map(lambda x: x, converted)
    wrong["params"]["layers_0"]["mlp"]["gate_up_proj"] = swapped
    control = generate(decoder, wrong, prompts, 8, key=jax.random.key(3), sampling=sampled).host()
    assert np.abs(control.raw_log_probs - want.raw_log_probs).max() > 1e-3
