"""DeepSeek-V3 checkpoints: latent attention, grouped sigmoid routing, parity, training, export, bad input.

The fixtures under tests/fixtures/hf/deepseek_v3* come from tools/hf_decoder_fixtures.py: tiny random
models keeping the released structure (a low-rank query, a compressed latent with a shared rope key,
nope/rope/value head widths, YaRN RoPE with its softmax mscale, a dense first layer, then sigmoid
routing with a balancing bias over the best 2 of 4 groups and a shared expert), and one without the
query's low rank, with transformers' logits and greedy continuation.
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

from dew.interop import PretrainedDecoder
from dew.interop.safetensors_io import SafetensorsFile
from dew.nn.backbones.causal_transformer import CausalTransformer
from hf_reference import FIXTURES, TOLERANCE, far, logits, moved_variables, reference, transformers_reads

NAMES = ["deepseek_v3", "deepseek_v3-full-q"]
MTP_NAME = "deepseek_v3-mtp"  # deepseek_v3 with a multi-token prediction layer after its last


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedDecoder.load(FIXTURES / name) for name in NAMES + [MTP_NAME]}


def params_of(bundle):
    return jax.tree_util.tree_map(lambda x: x, nn.unbox(bundle.variables)["params"])


# --- parity with transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_loaded_checkpoint_matches_transformers_logits_and_greedy_tokens(loaded, name):
    bundle, ref = loaded[name], reference(name)
    np.testing.assert_allclose(logits(bundle.model, bundle.variables, ref["input_ids"]), ref["logits"],
                               atol=TOLERANCE, rtol=0)
    result = bundle.text_generation()(ref["prompt"], ref["greedy"].shape[1], key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, ref["greedy"])


def test_loading_translates_the_config(loaded):
    model = loaded["deepseek_v3"].model
    assert dict(model.latent_attention) == dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                v_head_dim=8, q_lora_rank=24, rope_interleave=True)
    assert model.mlp_plan == ("dense", "mixture", "mixture") and model.hidden_features == 48
    assert dict(model.mixture) == dict(num_experts=8, top_k=3, expert_features=16, score="sigmoid", score_bias=True,
                                       groups=4, group_top_k=2, normalize_top_k=True, routed_scale=2.5,
                                       shared_expert_features=16)
    assert model.rope_scaling["rope_type"] == "yarn"
    other = loaded["deepseek_v3-full-q"].model
    assert other.latent_attention["q_lora_rank"] is None and other.mlp_plan == ("mixture", "mixture")
    assert other.mixture["shared_expert_features"] == 32 and other.rope_scaling is None


def test_the_comparison_catches_a_wrong_split_router_rope_or_scale(loaded):
    """Negative controls: each mistake a loader could make moves the logits far past the tolerance."""
    bundle, ref = loaded["deepseek_v3"], reference("deepseek_v3")
    ids, model = ref["input_ids"], bundle.model
    latent, mixture = dict(model.latent_attention), dict(model.mixture)

    swapped = params_of(bundle)  # each head read as [rope, nope] instead of [nope, rope]
    for i in range(3):
        kernel = swapped[f"layers_{i}"]["self_attn"]["q_b_proj"]["kernel"]
        heads = kernel.reshape(kernel.shape[0], 4, 12)
        swapped[f"layers_{i}"]["self_attn"]["q_b_proj"]["kernel"] = jnp.concatenate(
            [heads[..., 8:], heads[..., :8]], axis=-1).reshape(kernel.shape)
    assert far(logits(model, {**bundle.variables, "params": swapped}, ids), ref["logits"])

    # the balancing bias left out of the choice
    unbiased = {**bundle.variables, "balance": jax.tree_util.tree_map(jnp.zeros_like, bundle.variables["balance"])}
    assert far(logits(model, unbiased, ids), ref["logits"])

    wrong_models = [
        model.clone(latent_attention={**latent, "rope_interleave": False}),
        model.clone(mixture={**mixture, "group_top_k": 4}),  # every group allowed
        model.clone(mixture={**mixture, "score": "softmax"}),
        model.clone(mixture={**mixture, "routed_scale": 1.0}),
        # YaRN without its softmax mscale
        model.clone(rope_scaling={k: v for k, v in model.rope_scaling.items() if k != "mscale_all_dim"}),
    ]
    for wrong in wrong_models:
        assert far(logits(wrong, bundle.variables, ids), ref["logits"])


def test_the_cache_holds_latents_and_decodes_as_the_full_forward_does(loaded):
    bundle = loaded["deepseek_v3"]
    model, variables = bundle.model, bundle.variables
    ids = jnp.asarray(reference("deepseek_v3")["input_ids"])
    full = logits(model, variables, ids)
    cache = model.init_cache(2, max_len=16)
    # one token's cache entry is its latent and its shared rope key: 16 + 4 numbers per layer
    assert cache.k[0].shape == (2, 20, 16) and cache.v[0].shape == (2, 16, 0)
    step = jax.jit(lambda v, t, c: model.apply(v, t, cache=c))
    out, cache = step(variables, ids[:, :5], cache)
    np.testing.assert_allclose(np.asarray(out), full[:, :5], atol=1e-5, rtol=0)
    for t in range(5, 12):
        out, cache = step(variables, ids[:, t:t + 1], cache)
        np.testing.assert_allclose(np.asarray(out[:, 0]), full[:, t], atol=1e-5, rtol=0)


def test_scanned_latent_layers_compute_and_decode_what_unrolled_ones_do():
    name = "deepseek_v3-full-q"  # every layer a mixture, so the layers scan
    bundle, ref = PretrainedDecoder.load(FIXTURES / name, scan_layers=True), reference(name)
    assert bundle.model.scan_layers
    np.testing.assert_allclose(logits(bundle.model, bundle.variables, ref["input_ids"]), ref["logits"],
                               atol=TOLERANCE, rtol=0)
    result = bundle.text_generation()(ref["prompt"], ref["greedy"].shape[1], key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, ref["greedy"])


# --- training and export ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_save_writes_the_checkpoint_it_read(tmp_path, loaded, name):
    out = loaded[name].save(tmp_path / "export")
    original = SafetensorsFile(FIXTURES / name / "model.safetensors")
    exported = SafetensorsFile(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for tensor in original:
        np.testing.assert_array_equal(exported[tensor], original[tensor])
    config = json.loads((out / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
                "routed_scaling_factor", "rope_interleave", "rope_parameters"):
        assert config[key] == source[key], key
    assert PretrainedDecoder.load(out).model == loaded[name].model


def test_a_trainer_update_exports_and_reloads(tmp_path, loaded):
    from dew import Dataset, Trainer
    from dew.objectives.lm import LMObjective

    bundle = loaded["deepseek_v3"]
    rows = np.random.default_rng(0).integers(3, 128, size=(8, 13)).astype(np.int32)
    trainer = Trainer(LMObjective(bundle, seq_len=12), optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records({"text": rows}, batch=8), steps=1, log_every=1)
    trained, before = nn.unbox(state.variables)["params"], params_of(bundle)
    for path in (("layers_0", "self_attn", "kv_b_proj", "kernel"), ("layers_1", "mlp", "gate"),
                 ("layers_1", "mlp", "experts", "up_proj"), ("layers_2", "self_attn", "q_a_proj", "kernel")):
        a, b = trained, before
        for key in path:
            a, b = a[key], b[key]
        assert not np.allclose(np.asarray(a), np.asarray(b)), path
    # the balancing bias chooses experts but is no parameter: without a bias_update_rate nothing moves it
    np.testing.assert_array_equal(np.asarray(state.variables["balance"]["layers_1"]["mlp"]["score_bias"]),
                                  np.asarray(bundle.variables["balance"]["layers_1"]["mlp"]["score_bias"]))
    out = bundle.save(tmp_path / "trained", variables=state.variables)
    again = PretrainedDecoder.load(out)
    ids = rows[:2, :12]
    np.testing.assert_array_equal(logits(again.model, again.variables, ids), logits(bundle.model, state.variables, ids))
    assert far(logits(again.model, again.variables, ids), logits(bundle.model, bundle.variables, ids))


def test_a_latent_attention_model_built_in_dew_exports_as_deepseek_v3(tmp_path):
    model = CausalTransformer(
        vocab_size=64, emb_features=32, num_layers=2, num_heads=4, head_dim=4, mlp_features=40, max_seq_len=32,
        tie_embeddings=False, qk_norm=False, first_k_dense=1,
        latent_attention=dict(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        mixture=dict(num_experts=4, top_k=2, expert_features=8, score="sigmoid", score_bias=True, groups=2,
                     group_top_k=1, normalize_top_k=True, shared_expert_features=8),
    )
    ids = np.arange(20, dtype=np.int32).reshape(2, 10) % 64
    variables = nn.unbox(model.init(jax.random.key(0), ids))
    out = PretrainedDecoder.from_model(model, variables).save(tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["q_lora_rank"], config["first_k_dense_replace"]) == ("deepseek_v3", None, 1)
    again = PretrainedDecoder.load(out)
    assert dict(again.model.latent_attention) == {**model.latent_attention, "q_lora_rank": None,
                                                  "rope_interleave": False}
    np.testing.assert_array_equal(logits(again.model, again.variables, ids), logits(model, variables, ids))
    with pytest.raises(ValueError, match="latent attention cannot be exported as qwen3"):
        from dew.interop.families import qwen3

        qwen3.hf_config(model)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(n_group=3), "groups=3 does not divide num_experts=8"),
        (dict(num_experts_per_tok=9), "top_k=9 is larger than num_experts=8"),
    ],
)
def test_checkpoint_settings_dew_does_not_implement_are_named(tmp_path, change, message):
    directory = tmp_path / "deepseek_v3"
    shutil.copytree(FIXTURES / "deepseek_v3", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        PretrainedDecoder.load(directory)


def test_an_incomplete_multi_token_prediction_layer_or_a_stray_tensor_is_refused(tmp_path):
    from dew.interop.safetensors_io import save_file

    directory = tmp_path / "deepseek_v3"
    shutil.copytree(FIXTURES / "deepseek_v3", directory)
    tensors = dict(SafetensorsFile(directory / "model.safetensors"))
    tensors = {name: np.array(value) for name, value in tensors.items()}
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)  # a layer after the last, alone
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.3.enorm.weight'"):
        PretrainedDecoder.load(directory)
    del tensors["model.layers.3.eh_proj.weight"]
    tensors["model.layers.2.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)  # inside the model: refused
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensors"):
        PretrainedDecoder.load(directory)


# --- live reference --------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES + [MTP_NAME])
def test_transformers_reads_a_trained_export_with_the_same_logits(tmp_path, loaded, name):
    bundle = loaded[name]
    moved = moved_variables(bundle)
    out = bundle.save(tmp_path / "export", variables=moved)
    ids = (np.arange(20).reshape(2, 10) * 37 % 128).astype(np.int32)
    result = transformers_reads(out, ids)
    assert result["model_type"] == "deepseek_v3"
    want = logits(bundle.model, moved, ids)
    np.testing.assert_allclose(np.asarray(result["logits"]), want, atol=TOLERANCE, rtol=0)
    assert far(want, logits(bundle.model, bundle.variables, ids))


# --- FP8 block weights -----------------------------------------------------------------------------

FP8_NAME = "deepseek_v3-fp8"
FP8_BLOCK = (4, 8)


def test_fp8_block_weights_read_as_transformers_dequantizes_them():
    from dew.interop import fp8_blocks

    ref = reference(FP8_NAME)
    checkpoint = SafetensorsFile(FIXTURES / FP8_NAME / "model.safetensors")
    names = [key.split("/", 1)[1] for key in ref.files if key.startswith("dequantized/")]
    assert len(names) == 72  # every projection of the layers but the router
    for name in names:
        got = fp8_blocks.dequantize(checkpoint[name], checkpoint[name + "_scale_inv"], FP8_BLOCK, name)
        np.testing.assert_array_equal(got, ref[f"dequantized/{name}"])  # exact in float32
    bundle = PretrainedDecoder.load(FIXTURES / FP8_NAME)
    params = nn.unbox(bundle.variables)["params"]
    np.testing.assert_array_equal(np.asarray(params["layers_1"]["self_attn"]["kv_b_proj"]["kernel"]).T,
                                  ref["dequantized/model.layers.1.self_attn.kv_b_proj.weight"])
    np.testing.assert_array_equal(np.asarray(params["layers_2"]["mlp"]["experts"]["down_proj"][5]).T,
                                  ref["dequantized/model.layers.2.mlp.experts.5.down_proj.weight"])
    np.testing.assert_allclose(logits(bundle.model, bundle.variables, ref["input_ids"]), ref["logits"],
                               atol=TOLERANCE, rtol=0)
    result = bundle.text_generation()(ref["prompt"], ref["greedy"].shape[1], key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, ref["greedy"])
    # negative control: the unquantized weights' logits are far from the quantized ones'
    assert far(ref["logits"], reference("deepseek_v3")["logits"])
    # and the scales spread over the wrong axis do not give transformers' values
    name = "model.layers.0.self_attn.o_proj.weight"
    wrong = fp8_blocks.dequantize(checkpoint[name], checkpoint[name + "_scale_inv"].T.reshape(8, 4), FP8_BLOCK)
    assert not np.array_equal(wrong, ref[f"dequantized/{name}"])


def test_fp8_block_weights_save_back_unchanged_and_trained_ones_requantize(tmp_path):
    from dew.interop import fp8_blocks

    bundle = PretrainedDecoder.load(FIXTURES / FP8_NAME)
    out = bundle.save(tmp_path / "export")
    original = SafetensorsFile(FIXTURES / FP8_NAME / "model.safetensors")
    exported = SafetensorsFile(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name in original:
        assert exported[name].dtype == original[name].dtype, name
        assert np.asarray(exported[name]).tobytes() == np.asarray(original[name]).tobytes(), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == list(FP8_BLOCK)

    params = params_of(bundle)  # a "trained" weight: one block grows past its scale's range
    kernel = params["layers_0"]["self_attn"]["o_proj"]["kernel"]
    # Dew's kernel is [in, out]: its [:8, :4] is the checkpoint's first 4 x 8 block; the next block shrinks
    params["layers_0"]["self_attn"]["o_proj"]["kernel"] = kernel.at[:8, :4].multiply(3.0).at[:8, 4:8].multiply(0.5)
    out = bundle.save(tmp_path / "trained", variables={**bundle.variables, "params": params})
    again = PretrainedDecoder.load(out)
    name = "model.layers.0.self_attn.o_proj.weight"
    written = SafetensorsFile(out / "model.safetensors")
    assert written[name].dtype == fp8_blocks.FP8
    moved = np.asarray(params["layers_0"]["self_attn"]["o_proj"]["kernel"]).T
    read = np.asarray(nn.unbox(again.variables)["params"]["layers_0"]["self_attn"]["o_proj"]["kernel"]).T
    assert np.abs(read - moved).max() <= np.abs(moved).max() / 16  # within e4m3's precision
    scales = np.asarray(written[name + "_scale_inv"])
    assert scales[0, 0] != original[name + "_scale_inv"][0, 0]  # the grown block got a fresh scale
    kept = np.ones(scales.shape, bool)
    kept[0, 0] = False
    np.testing.assert_array_equal(scales[kept], original[name + "_scale_inv"][kept])  # the others kept theirs
    assert np.asarray(written[name])[4:8, :8].tobytes() != original[name][4:8, :8].tobytes()  # shrunk values


def test_fp8_blocks_cut_short_by_the_weight_use_their_scale_for_the_elements_they_have():
    from dew.interop import fp8_blocks

    weight = np.random.default_rng(0).normal(size=(5, 11)).astype(np.float32)
    values, scale = fp8_blocks.quantize(weight, (4, 8))
    assert values.shape == (5, 11) and scale.shape == (2, 2)
    expected = np.empty_like(weight)
    for r in range(5):
        for c in range(11):
            expected[r, c] = np.float32(values[r, c].astype(np.float32) * scale[r // 4, c // 8])
    np.testing.assert_array_equal(fp8_blocks.dequantize(values, scale, (4, 8)), expected)
    assert np.abs(expected - weight).max() <= np.abs(weight).max() / 16
    again, same = fp8_blocks.quantize(expected, (4, 8), scale)
    assert again.tobytes() == values.tobytes() and same.tobytes() == scale.tobytes()


def test_fp8_checkpoints_dew_cannot_read_are_named(tmp_path):
    from dew.interop.safetensors_io import save_file

    directory = tmp_path / "fp8"
    shutil.copytree(FIXTURES / FP8_NAME, directory)
    config = json.loads((directory / "config.json").read_text())
    quantization = config["quantization_config"]
    for change, message in ((dict(quant_method="awq"), "quant_method='awq'"), (dict(fmt="e5m2"), "fmt='e5m2'"),
                            (dict(activation_scheme="static"), "activation_scheme='static'")):
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": {**quantization, **change}}))
        with pytest.raises(ValueError, match=message):
            PretrainedDecoder.load(directory)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match="no quantization_config"):
        PretrainedDecoder.load(directory)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {name: np.array(value) for name, value in SafetensorsFile(directory / "model.safetensors").items()}
    del tensors["model.layers.1.self_attn.q_b_proj.weight_scale_inv"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match="q_b_proj.weight_scale_inv'?, its block scales, is missing"):
        PretrainedDecoder.load(directory)


@pytest.mark.reference
def test_transformers_reads_dews_fp8_export_with_the_same_logits(tmp_path):
    bundle = PretrainedDecoder.load(FIXTURES / FP8_NAME)
    moved = moved_variables(bundle)
    out = bundle.save(tmp_path / "export", variables=moved)
    again = PretrainedDecoder.load(out)  # what was written: the moved weights in FP8 blocks
    ids = (np.arange(20).reshape(2, 10) * 37 % 128).astype(np.int32)
    result = transformers_reads(out, ids)
    want = logits(again.model, again.variables, ids)
    np.testing.assert_allclose(np.asarray(result["logits"]), want, atol=TOLERANCE, rtol=0)
    assert far(want, logits(bundle.model, bundle.variables, ids))


def test_the_server_decodes_latent_attention_from_its_compressed_cache(loaded):
    from dew.inference.serving import Server
    from dew.sampling import Sampling

    bundle, ref = loaded["deepseek_v3"], reference("deepseek_v3")
    server = Server.from_task(bundle.text_generation(), slots=2, capacity=24)
    greedy = Sampling(temperature=0.0)
    budget = ref["greedy"].shape[1]
    first = server.submit(ref["prompt"][0].tolist(), max_new_tokens=budget, sampling=greedy, seed=0)
    server.step()  # the second request joins while the first decodes
    second = server.submit(ref["prompt"][1].tolist(), max_new_tokens=budget, sampling=greedy, seed=1)
    while not (first.finished and second.finished):
        server.step()
    assert [first.tokens, second.tokens] == ref["greedy"].tolist()


# --- multi-token prediction layers ----------------------------------------------------------------


def test_multi_token_prediction_layers_load_frozen_train_untouched_and_save_back(tmp_path):
    from dew import Dataset, Trainer
    from dew.objectives.lm import LMObjective

    bundle, ref = PretrainedDecoder.load(FIXTURES / MTP_NAME), reference(MTP_NAME)
    original = SafetensorsFile(FIXTURES / MTP_NAME / "model.safetensors")
    mtp_names = sorted(name for name in original if name.startswith("model.layers.3."))
    assert "model.layers.3.eh_proj.weight" in mtp_names and "model.layers.3.mlp.gate.e_score_correction_bias" in mtp_names
    layer = bundle.variables["mtp"]["layers_0"]
    assert sorted(layer) == ["block", "eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head"]
    assert layer["eh_proj"]["kernel"].shape == (64, 32)  # Dew's [in, out] of [norm(embedding), norm(hidden)]
    np.testing.assert_array_equal(np.asarray(layer["block"]["mlp"]["experts"]["up_proj"][5]),
                                  original["model.layers.3.mlp.experts.5.up_proj.weight"].T)
    # the causal LM is the one transformers runs
    np.testing.assert_allclose(logits(bundle.model, bundle.variables, ref["input_ids"]), ref["logits"],
                               atol=TOLERANCE, rtol=0)

    rows = np.random.default_rng(0).integers(3, 128, size=(8, 13)).astype(np.int32)
    trainer = Trainer(LMObjective(bundle, seq_len=12), optax.adamw(1e-2, weight_decay=0.5), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records({"text": rows}, batch=8), steps=1, log_every=1)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]]
    assert paths and not any("mtp" in p or "eh_proj" in p for p in paths)  # frozen: no optimizer state
    out = bundle.save(tmp_path / "trained", variables=state.variables)
    exported = SafetensorsFile(out / "model.safetensors")
    assert sorted(exported) == sorted(original)  # every tensor it read
    for name in mtp_names:  # byte for byte, after a step that moved the model's own weights
        assert np.asarray(exported[name]).tobytes() == np.asarray(original[name]).tobytes(), name
    assert not np.array_equal(exported["model.layers.2.mlp.gate.weight"], original["model.layers.2.mlp.gate.weight"])
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    # negative control: a checkpoint without the layers (its config names one) writes none and says so
    plain = PretrainedDecoder.load(FIXTURES / "deepseek_v3")
    assert "mtp" not in plain.variables
    out = plain.save(tmp_path / "plain")
    assert not any(name.startswith("model.layers.3.") for name in SafetensorsFile(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_an_untrained_multi_token_prediction_checkpoint_saves_byte_for_byte(tmp_path):
    bundle = PretrainedDecoder.load(FIXTURES / MTP_NAME)
    out = bundle.save(tmp_path / "export")
    original = SafetensorsFile(FIXTURES / MTP_NAME / "model.safetensors")
    exported = SafetensorsFile(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name in original:
        assert np.asarray(exported[name]).tobytes() == np.asarray(original[name]).tobytes(), name
    broken = {**bundle.variables, "mtp": {"layers_0": {k: v for k, v in bundle.variables["mtp"]["layers_0"].items()
                                                       if k != "hnorm"}}}
    with pytest.raises(ValueError, match="has no 'layers_0/hnorm/scale'"):
        bundle.save(tmp_path / "broken", variables=broken)


def test_a_bundle_with_prediction_layers_keeps_its_weights_logical_axis_names(loaded):
    """The held mtp collection has no counterpart in a fresh init; the other collections still take
    their names from one, so tensor parallelism splits the vocabulary as it does without it."""
    from dew import Layout, MeshSpec, Trainer
    from dew.objectives.lm import LMObjective

    specs = {}
    for name in ("deepseek_v3", MTP_NAME):
        trainer = Trainer(LMObjective(loaded[name], seq_len=12), optax.adam(1e-3), key=jax.random.key(0),
                          mesh=MeshSpec(tensor=2), layout=Layout(min_shard=1))
        _, shardings = trainer._plan()
        specs[name] = shardings.variables["params"]["embed_tokens"]["embedding"].spec
    assert specs["deepseek_v3"][0] == "tensor"  # the vocabulary axis, by its logical name
    assert specs[MTP_NAME] == specs["deepseek_v3"]
