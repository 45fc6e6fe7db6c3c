"""GPT-OSS checkpoints: parity with transformers, MXFP4 experts, decoding, training, export, bad input.

tests/fixtures/hf/gpt_oss comes from tools/hf_decoder_fixtures.py: a tiny random GptOssForCausalLM
keeping gpt-oss-20b's structure (sliding and full layers alternating, attention sinks, q/k/v/o
biases, YaRN RoPE, top-4 biased routing over clamped-SwiGLU experts) with transformers' logits and
greedy continuation; its expert kernels are MXFP4 codes decoded by transformers, and
gpt_oss-mxfp4 holds the same model with those kernels packed as the release stores them.
"""

from __future__ import annotations

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.interop import PretrainedDecoder, codecs
from dew.interop.families import gpt_oss, llama
from dew.interop.safetensors_io import SafetensorsFile, save_file
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from hf_reference import FIXTURES, TOLERANCE, far, logits, moved_variables, transformers_reads

DENSE, PACKED = FIXTURES / "gpt_oss", FIXTURES / "gpt_oss-mxfp4"
REFERENCE = np.load(DENSE / "reference.npz")
IDS, LOGITS = REFERENCE["input_ids"], REFERENCE["logits"]


@pytest.fixture(scope="module")
def loaded():
    return {"dense": PretrainedDecoder.load(DENSE), "mxfp4": PretrainedDecoder.load(PACKED)}


def params(bundle):
    return jax.tree_util.tree_map(lambda x: x, nn.unbox(bundle.variables)["params"])


# --- parity with transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dense", "mxfp4"])
def test_gpt_oss_matches_transformers_logits_and_greedy_tokens(loaded, which):
    bundle = loaded[which]
    np.testing.assert_allclose(logits(bundle.model, bundle.variables, IDS), LOGITS, atol=TOLERANCE, rtol=0)
    # generate decodes with the KV cache: sinks and the sliding window apply to cached keys by position
    steps = REFERENCE["greedy"].shape[1]
    result = bundle.text_generation()(REFERENCE["prompt"], steps, key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, REFERENCE["greedy"])


def test_one_row_decodes_gpt_oss_from_the_decode_layout_as_transformers_does(loaded):
    bundle = loaded["dense"]
    steps = REFERENCE["greedy"].shape[1]
    result = bundle.text_generation()(REFERENCE["prompt"][1:], steps, key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, REFERENCE["greedy"][1:])


def test_scanned_layers_keep_each_layers_window_and_sinks(loaded):
    scanned = PretrainedDecoder.load(DENSE, scan_layers=True)
    np.testing.assert_allclose(logits(scanned.model, scanned.variables, IDS), LOGITS, atol=TOLERANCE, rtol=0)


def test_the_comparison_catches_dropped_sinks_an_unclamped_swiglu_and_all_full_attention(loaded):
    """Negative controls: each thing GPT-OSS adds moves the logits far past the tolerance if lost."""
    bundle = loaded["dense"]
    model, variables = bundle.model, bundle.variables
    assert not far(logits(model, variables, IDS), LOGITS)
    no_sinks = params(bundle)
    for layer in ("layers_0", "layers_1"):
        del no_sinks[layer]["self_attn"]["sinks"]
    assert far(logits(model.clone(attention_sinks=False), {"params": no_sinks}, IDS), LOGITS)
    assert far(logits(model.clone(mixture={**model.mixture, "swiglu_limit": 1e9}), variables, IDS), LOGITS)
    assert far(logits(model.clone(mixture={**model.mixture, "activation": "swiglu"}), variables, IDS), LOGITS)
    assert far(logits(model.clone(layer_types=("full_attention",) * 2), variables, IDS), LOGITS)
    assert far(logits(model.clone(rope_scaling=None), variables, IDS), LOGITS)
    no_router_bias = params(bundle)
    no_router_bias["layers_0"]["mlp"]["gate_bias"] = jnp.zeros_like(no_router_bias["layers_0"]["mlp"]["gate_bias"])
    assert far(logits(model, {"params": no_router_bias}, IDS), LOGITS)


def test_the_load_balancing_loss_is_the_one_transformers_reports(loaded):
    from dew.nn.moe import router_metrics

    bundle = loaded["dense"]
    _, recorded = bundle.model.apply(bundle.variables, jnp.asarray(REFERENCE["input_ids"]), mutable=["router"])
    np.testing.assert_allclose(float(router_metrics(recorded["router"])["balance"]), float(REFERENCE["aux_loss"]),
                               rtol=1e-5)
    # negative control: without the router's bias the experts chosen, and so the loss, change
    unbiased = params(bundle)
    for layer in ("layers_0", "layers_1"):
        unbiased[layer]["mlp"]["gate_bias"] = jnp.zeros_like(unbiased[layer]["mlp"]["gate_bias"])
    _, recorded = bundle.model.apply({"params": unbiased}, jnp.asarray(REFERENCE["input_ids"]), mutable=["router"])
    assert abs(float(router_metrics(recorded["router"])["balance"]) - float(REFERENCE["aux_loss"])) > 1e-3


def test_loading_translates_the_config(loaded):
    model = loaded["dense"].model
    assert model.layer_types == ("sliding_attention", "full_attention")
    assert [kind.window for kind in model.layer_plan] == [4, None]
    assert (model.attention_sinks, model.attention_bias, model.qk_norm, model.tie_embeddings) == (True, True, False, False)
    assert model.rope_scaling["rope_type"] == "yarn" and model.rope_scaling["truncate"] is False
    assert dict(model.mixture) == dict(gpt_oss.MIXTURE_SETTINGS, num_experts=8, top_k=4, expert_features=32,
                                       swiglu_alpha=1.702, swiglu_limit=7.0)
    config = json.loads((DENSE / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "rms_norm_eps"):
        config.pop(key)
    defaults = CausalTransformer(**gpt_oss.model_kwargs({**config, "num_hidden_layers": 3}))
    assert defaults.layer_types == ("sliding_attention", "full_attention", "sliding_attention")  # transformers' default
    assert dict(defaults.rope_scaling)["factor"] == 32.0 and defaults.rope_theta == 150000.0
    assert defaults.norm_eps == 1e-5
    with pytest.raises(ValueError, match="gpt_oss layers are 'sliding_attention' or 'full_attention'"):
        gpt_oss.model_kwargs({**config, "layer_types": ["chunked_attention", "full_attention"]})


# --- MXFP4 -----------------------------------------------------------------------------------------


def test_mxfp4_experts_decode_to_exactly_what_transformers_reads(loaded):
    packed, dense = SafetensorsFile(PACKED / "model.safetensors"), SafetensorsFile(DENSE / "model.safetensors")
    names = sorted(loaded["mxfp4"].packed_scales)
    assert names == [f"model.layers.{i}.mlp.experts.{kernel}" for i in (0, 1) for kernel in ("down_proj", "gate_up_proj")]
    for name in names:  # the dense fixture holds transformers' decoding of the same codes
        decoded = codecs.dequantize_packed_mxfp4(packed[name + "_blocks"], packed[name + "_scales"])
        assert decoded.dtype == np.float32
        np.testing.assert_array_equal(decoded, dense[name])
    for a, b in zip(jax.tree_util.tree_leaves(params(loaded["mxfp4"])), jax.tree_util.tree_leaves(params(loaded["dense"]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # negative control: the nibbles in the other order decode to other values
    blocks = packed[names[0] + "_blocks"]
    swapped = (blocks >> 4) | ((blocks & 0x0F) << 4)
    assert not np.array_equal(codecs.dequantize_packed_mxfp4(swapped, packed[names[0] + "_scales"]), dense[names[0]])


def test_mxfp4_encoding_round_trips_and_rounds_to_the_nearest_value():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 6, 2, 16), dtype=np.uint8)
    scales = (127 + rng.integers(-4, 2, (2, 6, 2))).astype(np.uint8)
    values = codecs.dequantize_packed_mxfp4(blocks, scales)
    assert values.shape == (2, 64, 6)
    again_blocks, again_scales = codecs.quantize_packed_mxfp4(values, scales)
    np.testing.assert_array_equal(again_blocks, blocks)  # the scales read with keep every byte
    np.testing.assert_array_equal(again_scales, scales)
    fresh = codecs.quantize_packed_mxfp4(values)  # without them: the same values, maybe other bytes
    np.testing.assert_array_equal(codecs.dequantize_packed_mxfp4(*fresh), values)
    # arbitrary values: the largest of each block fits under 6 * 2^e, the others round to nearest
    weights = rng.standard_normal((64, 6)).astype(np.float32)
    decoded = codecs.dequantize_packed_mxfp4(*codecs.quantize_packed_mxfp4(weights))
    grid = np.ldexp(codecs.FP4_VALUES[:8], 0)
    for column in range(6):
        for start in (0, 32):
            block, got = weights[start:start + 32, column], decoded[start:start + 32, column]
            exponent = int(np.ceil(np.log2(np.abs(block).max() / 6.0)))
            candidates = np.sign(block)[:, None] * np.ldexp(grid, exponent)[None, :]
            nearest = np.abs(candidates - block[:, None]).min(axis=1)
            np.testing.assert_allclose(np.abs(got - block), nearest, atol=0, rtol=0)
    # as downcast_to_mxfp rounds: a tie goes away from zero (5 between 4 and 6, 1.25 between 1 and
    # 1.5, -0.75 between -0.5 and -1, 0.25 between 0 and 0.5), and the scale is max / 6 rounded up
    tie = np.zeros((32, 1), np.float32)
    tie[:6, 0] = [6.0, 5.0, 1.25, -0.75, 0.25, 0.2]
    blocks, scales = codecs.quantize_packed_mxfp4(tie)
    assert scales.tolist() == [[127]]
    np.testing.assert_array_equal(codecs.dequantize_packed_mxfp4(blocks, scales)[:6, 0], [6.0, 6.0, 1.5, -1.0, 0.5, 0.0])
    assert codecs.quantize_packed_mxfp4(tie * np.float32(1.01))[1].tolist() == [[128]]  # 6.06 needs the next scale
    assert codecs.quantize_packed_mxfp4(np.zeros((32, 1), np.float32))[1].tolist() == [[0]]


def test_save_writes_the_checkpoint_it_read_mxfp4_bytes_included(tmp_path, loaded):
    for which, source in (("dense", DENSE), ("mxfp4", PACKED)):
        out = loaded[which].save(tmp_path / which)
        original, exported = SafetensorsFile(source / "model.safetensors"), SafetensorsFile(out / "model.safetensors")
        assert sorted(exported) == sorted(original)
        for tensor in original:
            assert exported[tensor].dtype == original[tensor].dtype, tensor
            np.testing.assert_array_equal(exported[tensor], original[tensor])
        config = json.loads((out / "config.json").read_text())
        source_config = json.loads((source / "config.json").read_text())
        for key in ("layer_types", "sliding_window", "rope_parameters", "num_local_experts", "swiglu_limit",
                    "attention_bias", "quantization_config"):
            assert config.get(key) == source_config.get(key), key
        assert PretrainedDecoder.load(out).model == loaded[which].model


def test_a_quantized_tensor_without_its_scales_is_refused(tmp_path):
    directory = tmp_path / "broken"
    shutil.copytree(PACKED, directory)
    tensors = dict(SafetensorsFile(PACKED / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.down_proj_blocks' without "
                                         r"'model.layers.1.mlp.experts.down_proj_scales'"):
        PretrainedDecoder.load(directory)
    with pytest.raises(ValueError, match="blocks of 32 along its input axis"):
        codecs.quantize_packed_mxfp4(np.zeros((2, 16, 4), np.float32))
    with pytest.raises(ValueError, match=r"blocks \[..., out, in / 32, 16\]"):
        codecs.dequantize_packed_mxfp4(np.zeros((4, 2, 8), np.uint8), np.zeros((4, 2), np.uint8))


# --- training and export ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dense", "mxfp4"])
def test_a_trainer_update_exports_and_reloads(tmp_path, loaded, which):
    from dew import Dataset, Trainer
    from dew.objectives.lm import LMObjective

    bundle = loaded[which]
    rows = np.random.default_rng(0).integers(3, 128, size=(8, 13)).astype(np.int32)
    trainer = Trainer(LMObjective(bundle, seq_len=12, balance_coef=0.001), optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records({"text": rows}, batch=8), steps=1, log_every=1)
    assert "router/balance" in trainer.history[-1]
    trained = nn.unbox(state.variables)["params"]
    before = params(bundle)
    for path in (("self_attn", "sinks"), ("mlp", "gate_bias"), ("mlp", "experts", "gate_up_proj_bias"),
                 ("mlp", "experts", "down_proj")):
        new, old = trained["layers_0"], before["layers_0"]
        for key in path:
            new, old = new[key], old[key]
        assert not np.allclose(np.asarray(new), np.asarray(old)), path
    out = bundle.save(tmp_path / "trained", variables=state.variables)
    again = PretrainedDecoder.load(out)
    ids = rows[:2, :12]
    if which == "dense":
        np.testing.assert_array_equal(logits(again.model, again.variables, ids), logits(bundle.model, state.variables, ids))
    else:  # the trained expert kernels are packed again: the reload holds their MXFP4 rounding
        reloaded = nn.unbox(again.variables)["params"]["layers_0"]["mlp"]["experts"]["down_proj"]
        kernel = np.asarray(trained["layers_0"]["mlp"]["experts"]["down_proj"])
        np.testing.assert_array_equal(np.asarray(reloaded),
                                      codecs.dequantize_packed_mxfp4(*codecs.quantize_packed_mxfp4(kernel)))
        np.testing.assert_array_equal(np.asarray(nn.unbox(again.variables)["params"]["layers_0"]["self_attn"]["sinks"]),
                                      np.asarray(trained["layers_0"]["self_attn"]["sinks"]))
    assert far(logits(again.model, again.variables, ids), logits(bundle.model, bundle.variables, ids))


def test_a_model_with_sinks_built_in_dew_exports_as_gpt_oss(tmp_path):
    model = CausalTransformer(
        vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=32,
        tie_embeddings=False, qk_norm=False, attention_bias=True, attention_sinks=True,
        layer_types=("sliding_attention", "full_attention"), kinds={"sliding_attention": LayerKind(window=3)},
        mixture=dict(gpt_oss.MIXTURE_SETTINGS, num_experts=4, top_k=2, expert_features=16),
    )
    ids = np.arange(20, dtype=np.int32).reshape(2, 10) % 64
    variables = nn.unbox(model.init(jax.random.key(0), ids))
    out = PretrainedDecoder.from_model(model, variables).save(tmp_path / "gpt_oss")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    again = PretrainedDecoder.load(out)
    assert again.model.layer_plan == model.layer_plan
    np.testing.assert_array_equal(logits(again.model, again.variables, ids), logits(model, variables, ids))
    with pytest.raises(ValueError, match="attention_sinks=True cannot be exported as llama"):
        llama.hf_config(model.clone(mixture=None))
    with pytest.raises(ValueError, match="cannot be exported as gpt_oss"):
        gpt_oss.hf_config(model.clone(mixture={**model.mixture, "activation": "swiglu"}))
    with pytest.raises(ValueError, match="attention_sinks=False cannot be exported as gpt_oss"):
        gpt_oss.hf_config(model.clone(attention_sinks=False))
    with pytest.raises(ValueError, match="GPT-OSS's experts export as gpt_oss"):  # no sinks: tried as mixtral
        PretrainedDecoder.from_model(model.clone(attention_sinks=False), variables)


# --- live reference --------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("which", ["dense", "mxfp4"])
def test_transformers_reads_a_trained_gpt_oss_export_with_the_same_logits(tmp_path, loaded, which):
    bundle = loaded[which]
    moved = moved_variables(bundle)
    out = bundle.save(tmp_path / "export", variables=moved)
    again = PretrainedDecoder.load(out)  # for MXFP4, the weights as packed
    ids = (np.arange(20).reshape(2, 10) * 37 % 128).astype(np.int32)
    result = transformers_reads(out, ids)
    assert result["model_type"] == "gpt_oss"
    want = logits(again.model, again.variables, ids)
    np.testing.assert_allclose(np.asarray(result["logits"]), want, atol=TOLERANCE, rtol=0)
    assert far(want, logits(bundle.model, bundle.variables, ids))
