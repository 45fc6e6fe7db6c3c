"""Hugging Face decoder checkpoints: loading, parity with transformers, export, and bad input.

The fixtures under tests/fixtures/hf/ come from tools/hf_decoder_fixtures.py (tiny random
LlamaForCausalLM / Qwen3ForCausalLM / MistralForCausalLM in float32, with transformers' logits and
greedy output).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data.tokenizers import HFTokenizer
from dew.interop import Pretrained, PretrainedDecoder
from dew.interop import decoder as decoder_module
from dew.interop.safetensors_io import INDEX_FILE, SafetensorsFile, save_file
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.sampling.text import Sampling
from hf_reference import transformers_reads

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/hf"
TOKENIZER = ROOT / "tests/fixtures/tokenizers/tiny-tools"
TOLERANCE = 1e-4
NAMES = ["llama", "qwen3", "qwen3-sliding", "mistral"]


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def logits(bundle, ids, variables=None):
    return np.asarray(bundle.model.apply(bundle.variables if variables is None else variables, jnp.asarray(ids)))


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedDecoder.load(FIXTURES / name) for name in NAMES}


def copy_fixture(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    (target / "reference.npz").unlink()
    return target


def small_model(**overrides):
    settings = dict(vocab_size=96, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    mlp_features=48, max_seq_len=32)
    settings.update(overrides)
    return CausalTransformer(**settings)


def init(model, seed=0):
    """Random variables with the norm scales moved off 1, so every tensor shows in the logits."""
    variables = unboxed(jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32)))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(np.float32)), variables
    )


def unboxed(variables):
    from flax.core import meta

    return meta.unbox(variables)


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# --- parity with transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_loaded_checkpoint_matches_transformers_logits(loaded, name):
    ref = reference(name)
    got = logits(loaded[name], ref["input_ids"])
    np.testing.assert_allclose(got, ref["logits"], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers_token_for_token(loaded, name):
    ref = reference(name)
    task = loaded[name].text_generation()
    assert task.sampling.greedy and task.sampling.eos_token_ids == (2,)  # from generation_config.json
    result = task(ref["prompt"], ref["greedy"].shape[1], key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, ref["greedy"])


def test_the_comparison_fails_for_a_transposed_weight_a_swapped_norm_wrong_rope_windows_and_groups(loaded):
    """Negative controls: each mistake a loader could make moves the logits far past the tolerance."""
    def far(got, ref):
        return np.abs(got - ref).max() > 100 * TOLERANCE

    llama, ref = loaded["llama"], reference("llama")
    params = unboxed(llama.variables)["params"]
    kernel = params["layers_0"]["self_attn"]["q_proj"]["kernel"]  # [64, 64]: a transpose still fits
    transposed = jax.tree_util.tree_map(lambda x: x, params)
    transposed["layers_0"]["self_attn"]["q_proj"]["kernel"] = kernel.T
    assert far(logits(llama, ref["input_ids"], {"params": transposed}), ref["logits"])

    wrong_theta = llama.model.clone(rope_theta=10000.0)
    assert far(np.asarray(wrong_theta.apply(llama.variables, ref["input_ids"])), ref["logits"])
    no_scaling = llama.model.clone(rope_scaling=None)
    assert far(np.asarray(no_scaling.apply(llama.variables, ref["input_ids"])), ref["logits"])

    qwen, ref = loaded["qwen3"], reference("qwen3")
    swapped = jax.tree_util.tree_map(lambda x: x, unboxed(qwen.variables)["params"])
    attn = swapped["layers_1"]["self_attn"]
    attn["q_norm"], attn["k_norm"] = attn["k_norm"], attn["q_norm"]
    assert far(logits(qwen, ref["input_ids"], {"params": swapped}), ref["logits"])

    sliding, ref = loaded["qwen3-sliding"], reference("qwen3-sliding")
    no_window = sliding.model.clone(layer_types=None, kinds=None)
    assert far(np.asarray(no_window.apply(sliding.variables, ref["input_ids"])), ref["logits"])

    mistral, ref = loaded["mistral"], reference("mistral")
    no_window = mistral.model.clone(layer_types=None, kinds=None)
    assert far(np.asarray(no_window.apply(mistral.variables, ref["input_ids"])), ref["logits"])
    # grouped-query attention: query heads 0-3 read key/value head 0 and heads 4-7 head 1. Reordering
    # the query heads (and the output rows that read them) inside their groups keeps the logits;
    # across groups, as a loader that tiled the key/value heads instead of repeating them would, it
    # moves them far.
    def reorder_query_heads(order):
        order = np.asarray(order)
        params = jax.tree_util.tree_map(lambda x: x, unboxed(mistral.variables)["params"])
        attn = params["layers_0"]["self_attn"]
        heads, width = len(order), attn["q_proj"]["kernel"].shape[0]
        q = attn["q_proj"]["kernel"].reshape(width, heads, -1)[:, order]
        o = attn["o_proj"]["kernel"].reshape(heads, -1, width)[order]
        attn["q_proj"]["kernel"], attn["o_proj"]["kernel"] = q.reshape(width, -1), o.reshape(-1, width)
        return logits(mistral, ref["input_ids"], {"params": params})

    np.testing.assert_allclose(reorder_query_heads([1, 0, 3, 2, 5, 4, 7, 6]), ref["logits"], atol=TOLERANCE, rtol=0)
    assert far(reorder_query_heads([0, 2, 4, 6, 1, 3, 5, 7]), ref["logits"])


def test_loading_translates_the_config(loaded):
    llama, qwen, sliding = loaded["llama"].model, loaded["qwen3"].model, loaded["qwen3-sliding"].model
    assert (llama.qk_norm, llama.tie_embeddings) == (False, False)
    assert (llama.rope_theta, llama.norm_eps) == (500000.0, 1e-5)
    assert dict(llama.rope_scaling)["rope_type"] == "llama3"
    assert (qwen.qk_norm, qwen.tie_embeddings, qwen.rope_theta, qwen.rope_scaling) == (True, True, 1e6, None)
    assert (llama.kv_heads, llama.head_features, llama.hidden_features, llama.max_seq_len) == (2, 16, 128, 64)
    assert sliding.layer_types == ("full_attention", "sliding_attention")
    assert [kind.window for kind in sliding.layer_plan] == [None, 4]
    assert "lm_head" not in loaded["qwen3"].variables["params"]
    assert loaded["llama"].tokenizer is None and loaded["llama"].generation_config["eos_token_id"] == 2
    assert loaded["qwen3"].config["model_type"] == "qwen3"
    mistral = loaded["mistral"].model
    assert (mistral.num_heads, mistral.num_kv_heads, mistral.head_dim) == (8, 2, 8)
    assert (mistral.rope_theta, mistral.tie_embeddings, mistral.qk_norm) == (10000.0, False, False)
    assert [kind.window for kind in mistral.layer_plan] == [4, 4]


def test_load_options_set_dtypes_context_and_scanned_layers(loaded):
    ref = reference("llama")
    bundle = PretrainedDecoder.load(FIXTURES / "llama", param_dtype=jnp.bfloat16, max_seq_len=32)
    assert bundle.model.max_seq_len == 32
    assert {x.dtype for x in jax.tree_util.tree_leaves(bundle.variables)} == {jnp.dtype(jnp.bfloat16)}
    # bfloat16 storage with float32 compute is exactly the float32 model on weights rounded to bfloat16,
    # and the rounding is real: those logits leave the float32 reference's tolerance
    rounded = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32),
                                     unboxed(loaded["llama"].variables))
    stored = logits(bundle, ref["input_ids"])
    np.testing.assert_array_equal(stored, logits(loaded["llama"], ref["input_ids"], rounded))
    assert np.abs(stored - ref["logits"]).max() > 100 * TOLERANCE

    scanned = PretrainedDecoder.load(FIXTURES / "qwen3", scan_layers=True)
    assert scanned.variables["params"]["layers"]["self_attn"]["q_norm"]["scale"].shape == (2, 16)
    np.testing.assert_allclose(logits(scanned, reference("qwen3")["input_ids"]),
                               reference("qwen3")["logits"], atol=TOLERANCE, rtol=0)


def test_pretrained_load_dispatches_on_model_type():
    bundle = Pretrained.load(FIXTURES / "qwen3")
    assert isinstance(bundle, PretrainedDecoder) and bundle.model.qk_norm


def test_a_mistral_config_loads_with_every_layer_on_its_window_and_exports_as_mistral(tmp_path, loaded):
    directory = copy_fixture("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=5)
    (directory / "config.json").write_text(json.dumps(config))
    bundle = PretrainedDecoder.load(directory)
    assert [kind.window for kind in bundle.model.layer_plan] == [5, 5]
    ids = reference("llama")["input_ids"]  # 12 tokens: the window changes the logits
    assert np.abs(logits(bundle, ids) - logits(loaded["llama"], ids)).max() > 100 * TOLERANCE
    exported = json.loads((bundle.save(tmp_path / "export") / "config.json").read_text())
    assert (exported["model_type"], exported["sliding_window"]) == ("mistral", 5)


def test_a_sharded_checkpoint_loads_like_a_single_file(tmp_path, loaded):
    directory = copy_fixture("llama", tmp_path)
    tensors = {name: np.array(t) for name, t in SafetensorsFile(directory / "model.safetensors").items()}
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, directory / shard)
        weight_map.update({n: shard for n in shard_names})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    bundle = PretrainedDecoder.load(directory)
    ids = reference("llama")["input_ids"]
    np.testing.assert_array_equal(logits(bundle, ids), logits(loaded["llama"], ids))


# --- export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_save_then_load_gives_identical_params_and_logits(tmp_path, loaded, name):
    source = loaded[name]
    out = source.save(tmp_path / "export")
    again = PretrainedDecoder.load(out)
    for a, b in zip(jax.tree_util.tree_leaves(source.variables), jax.tree_util.tree_leaves(again.variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = reference(name)["input_ids"]
    np.testing.assert_array_equal(logits(again, ids), logits(source, ids))
    assert again.model == source.model
    # the same tensor names and bytes as the transformers checkpoint it came from
    original = SafetensorsFile(FIXTURES / name / "model.safetensors")
    exported = SafetensorsFile(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for tensor in original:
        np.testing.assert_array_equal(exported[tensor], original[tensor])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == source.config["model_type"]
    assert config["torch_dtype"] == "float32"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_a_decoder_without_qk_norm_exports_as_llama_with_torch_names_and_shapes(tmp_path):
    model = small_model(qk_norm=False, tie_embeddings=False, attention_bias=True, mlp_bias=True)
    variables = init(model)
    out = PretrainedDecoder.from_model(model, variables).save(tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (32, 2, 16)
    assert config["tie_word_embeddings"] is False and config["mlp_bias"] is True
    tensors = SafetensorsFile(out / "model.safetensors")
    assert tensors.shape("model.layers.0.self_attn.q_proj.weight") == (64, 32)  # [out, in]
    assert tensors.shape("model.layers.1.self_attn.k_proj.weight") == (32, 32)
    assert tensors.shape("model.layers.1.self_attn.o_proj.bias") == (32,)
    assert tensors.shape("model.layers.0.mlp.down_proj.weight") == (32, 48)
    assert tensors.shape("lm_head.weight") == (96, 32)
    assert tensors.shape("model.embed_tokens.weight") == (96, 32)
    assert not any("q_norm" in name for name in tensors)
    kernel = unboxed(variables)["params"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"], np.asarray(kernel).T)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    again = PretrainedDecoder.load(out)
    np.testing.assert_array_equal(logits(again, ids), np.asarray(model.apply(variables, ids)))


def test_a_decoder_with_qk_norm_exports_as_qwen3_without_a_tied_head(tmp_path):
    model = small_model()  # the defaults: qk_norm=True, tie_embeddings=True
    variables = init(model)
    out = PretrainedDecoder.from_model(model, variables).save(tmp_path / "qwen3")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert config["tie_word_embeddings"] is True and config["use_sliding_window"] is False
    tensors = SafetensorsFile(out / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors.shape("model.layers.1.self_attn.q_norm.weight") == (16,)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    again = PretrainedDecoder.load(out)
    np.testing.assert_array_equal(logits(again, ids), np.asarray(model.apply(variables, ids)))


def test_sliding_layers_and_rope_scaling_survive_an_export(tmp_path):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    model = small_model(layer_types=("sliding_attention", "full_attention"), rope_scaling=scaling,
                        kinds={"sliding_attention": LayerKind(window=3)})
    variables = init(model)
    out = PretrainedDecoder.from_model(model, variables).save(tmp_path / "sliding")
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert (config["use_sliding_window"], config["sliding_window"]) == (True, 3)
    assert config["rope_scaling"] == scaling
    again = PretrainedDecoder.load(out)
    ids = np.arange(20, dtype=np.int32).reshape(2, 10) % 96
    np.testing.assert_allclose(logits(again, ids), np.asarray(model.apply(variables, ids)), atol=1e-6)


def test_scanned_layers_export_and_reload(tmp_path):
    model = small_model(scan_layers=True)
    variables = init(model)
    out = PretrainedDecoder.from_model(model, variables).save(tmp_path / "scanned")
    assert "model.layers.1.mlp.up_proj.weight" in SafetensorsFile(out / "model.safetensors")
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    want = np.asarray(model.apply(variables, ids))
    np.testing.assert_allclose(logits(PretrainedDecoder.load(out), ids), want, atol=1e-6)
    np.testing.assert_allclose(logits(PretrainedDecoder.load(out, scan_layers=True), ids), want, atol=1e-6)


def test_bfloat16_params_export_as_bfloat16(tmp_path):
    bundle = PretrainedDecoder.load(FIXTURES / "qwen3", param_dtype=jnp.bfloat16)
    out = bundle.save(tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert SafetensorsFile(out / "model.safetensors")["model.norm.weight"].dtype == jnp.bfloat16
    again = PretrainedDecoder.load(out, param_dtype=jnp.bfloat16)
    for a, b in zip(jax.tree_util.tree_leaves(bundle.variables), jax.tree_util.tree_leaves(again.variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_export_is_readable_by_the_safetensors_package(tmp_path, loaded):
    from safetensors.numpy import load_file

    out = loaded["llama"].save(tmp_path / "export")
    ours = SafetensorsFile(out / "model.safetensors")
    theirs = load_file(str(out / "model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    np.testing.assert_array_equal(theirs["lm_head.weight"], ours["lm_head.weight"])


def test_an_export_carries_the_tokenizer_and_generation_defaults(tmp_path):
    tokenizer = HFTokenizer(TOKENIZER)
    model = small_model(vocab_size=tokenizer.vocab_size, qk_norm=False, tie_embeddings=False)
    variables = init(model)
    out = PretrainedDecoder.from_model(model, variables, tokenizer=tokenizer).save(tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tokenizer.eos_id

    task = PretrainedDecoder.load(out).text_generation()
    assert isinstance(task.tokenizer, HFTokenizer) and task.sampling.eos_token_ids == (tokenizer.eos_id,)
    drawn = task("The trainer", 6, key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    direct = task(np.asarray([tokenizer.encode("The trainer")], np.int32), 6, key=jax.random.key(1),
                  sampling=Sampling(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(drawn.tokens), np.asarray(direct.tokens))
    assert task.decode(drawn)[0] == tokenizer.decode(np.asarray(drawn.tokens)[0])  # the exported copy decodes alike


def test_a_trainer_step_changes_the_weights_and_the_export_reloads(tmp_path):
    from dew import Dataset, Trainer
    from dew.objectives.lm import LMObjective

    bundle = PretrainedDecoder.load(FIXTURES / "llama")
    rows = np.random.default_rng(0).integers(0, 128, size=(16, 17)).astype(np.int32)
    objective = LMObjective(bundle, seq_len=16)
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0)).fit(
        Dataset.from_records({"text": rows}, batch=8), steps=1, log_every=1)
    before = bundle.variables["params"]["layers_1"]["mlp"]["down_proj"]["kernel"]
    after = state.variables["params"]["layers_1"]["mlp"]["down_proj"]["kernel"]
    assert not np.allclose(np.asarray(before), np.asarray(after))
    out = bundle.save(tmp_path / "trained", variables=state.variables)
    again = PretrainedDecoder.load(out)
    ids = rows[:2, :16]
    np.testing.assert_array_equal(logits(again, ids), logits(bundle, ids, state.variables))
    assert not np.allclose(logits(again, ids), logits(bundle, ids))


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (dict(qk_norm=False, layer_types=("sliding_attention", "full_attention"),
              kinds={"sliding_attention": LayerKind(window=3)}), "layer_types"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(causal=False), "causal=False"),
        (dict(layer_types=("local", "sliding_attention"),
              kinds={"local": LayerKind(window=2), "sliding_attention": LayerKind(window=3)}), "sliding windows"),
        (dict(layer_types=("local", "full_attention"), kinds={"local": LayerKind(rope_theta=500.0)}),
         "rope_theta"),
    ],
)
def test_from_model_refuses_settings_no_family_can_express(overrides, setting):
    model = small_model(**overrides)
    with pytest.raises(ValueError, match=setting):
        PretrainedDecoder.from_model(model, {"params": {}})


def test_unsupported_model_types_are_refused_with_the_supported_list(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match=r"model_type='gpt_neox'.*\['deepseek_v3', 'gpt_oss', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        Pretrained.load(directory)
    (directory / "config.json").write_text(json.dumps(
        {**config, "model_type": "my_model", "auto_map": {"AutoModelForCausalLM": "modeling_my.MyModel"}}))
    (directory / "modeling_my.py").write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(ValueError, match="never imports or runs code"):
        PretrainedDecoder.load(directory)


def test_remote_code_in_a_supported_config_is_ignored_with_a_warning(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.warns(UserWarning, match="ignores it"):
        bundle = PretrainedDecoder.load(directory)
    assert "auto_map" not in bundle.export_config()


def test_a_missing_or_unexpected_tensor_is_named(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    # copies: the file is rewritten below, and SafetensorsFile's arrays are views of its bytes
    tensors = {name: np.array(t) for name, t in SafetensorsFile(directory / "model.safetensors").items()}
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError) as error:
        PretrainedDecoder.load(directory)
    assert "model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert "model.layers.0.self_attn.q_norm.weight" in str(error.value)


def test_a_tensor_whose_shape_disagrees_with_the_config_is_named(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight'.*\[128, 64\].*\[96, 64\]"):
        PretrainedDecoder.load(directory)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    for path in TOKENIZER.iterdir():
        shutil.copy(path, directory / path.name)
    with pytest.raises(ValueError, match="512 tokens.*vocab_size is 128"):
        PretrainedDecoder.load(directory)
    with pytest.raises(ValueError, match="512 tokens.*vocab_size is 96"):
        PretrainedDecoder.from_model(small_model(), {"params": {}}, tokenizer=HFTokenizer(TOKENIZER))


def test_missing_files_are_named(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        PretrainedDecoder.load(directory)
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        PretrainedDecoder.load(directory)
    with pytest.raises(FileNotFoundError, match="Llama-3.2-1B' could not be read from the cache"):
        Pretrained.load("meta-llama/Llama-3.2-1B")
    directory = copy_fixture("qwen3", tmp_path)
    (directory / "model.safetensors").unlink()
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.norm.weight": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-1.safetensors"):
        PretrainedDecoder.load(directory)


def test_unsupported_rope_settings_are_refused(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'dynamic'"):
        PretrainedDecoder.load(directory)


def test_save_refuses_a_non_empty_destination_unless_told_to_overwrite(tmp_path, loaded):
    dest = tmp_path / "export"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        loaded["qwen3"].save(dest)
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    loaded["qwen3"].save(dest, overwrite=True)
    assert (dest / "model.safetensors").is_file() and not (dest / "notes.txt").exists()
    assert leftovers(tmp_path) == []


def test_a_failed_save_leaves_nothing_behind(tmp_path, loaded, monkeypatch):
    bundle = loaded["llama"]
    wrong = jax.tree_util.tree_map(lambda x: x, unboxed(bundle.variables)["params"])
    wrong["norm"]["scale"] = jnp.ones(7)
    with pytest.raises(ValueError, match=r"'norm/scale'.*\[7\].*\[64\]"):
        bundle.save(tmp_path / "bad", variables={"params": wrong})
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(decoder_module, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        bundle.save(tmp_path / "partial")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    with pytest.raises(OSError, match="disk full"):
        bundle.save(previous, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]
    assert (previous / "config.json").read_text() == "{}"


# --- live reference --------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_transformers_reads_a_dew_export_with_the_same_logits(tmp_path, qk_norm):
    tokenizer = HFTokenizer(TOKENIZER)
    model = small_model(vocab_size=tokenizer.vocab_size, qk_norm=qk_norm, tie_embeddings=qk_norm,
                        rope_theta=50000.0,
                        layer_types=("full_attention", "sliding_attention") if qk_norm else None,
                        kinds={"sliding_attention": LayerKind(window=3)} if qk_norm else None,
                        rope_scaling=None if qk_norm else {"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8})
    variables = init(model)
    out = PretrainedDecoder.from_model(model, variables, tokenizer=tokenizer).save(tmp_path / "export")
    ids = (np.arange(20).reshape(2, 10) * 37 % tokenizer.vocab_size).astype(np.int32)
    result = transformers_reads(out, ids)
    assert result["model_type"] == ("qwen3" if qk_norm else "llama")
    assert result["tokenizer_vocab"] == tokenizer.vocab_size
    np.testing.assert_allclose(np.asarray(result["logits"]), np.asarray(model.apply(variables, ids)),
                               atol=TOLERANCE, rtol=0)
