"""LoRA adapters on published checkpoints: training the factors alone, merging, and PEFT's format.

Parity with PEFT: tests/fixtures/peft/llama-lora is an adapter trained by peft on the tiny Llama
fixture, and tests/fixtures/peft/{qwen3-moe,gpt-oss,deepseek-v3}-lora adapters on the tiny mixture
fixtures that also cover the experts' stacked parameters (target_parameters), each with the logits peft computed
(tools/peft_adapter_fixture.py); Dew loads them and matches them. The `reference` tests run peft
live on adapters Dew saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from dew import Checkpoints, Dataset, Trainer
from dew.interop import Pretrained
from dew.interop.safetensors_io import SafetensorsFile, save_file
from dew.nn.adapters import LoRA
from dew.objectives.lm import LMObjective

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "hf" / "llama"
QWEN3 = FIXTURES / "hf" / "qwen3"
PEFT_ADAPTER = FIXTURES / "peft" / "llama-lora"
QWEN3_MOE = FIXTURES / "hf" / "qwen3_moe"
MOE_ADAPTER = FIXTURES / "peft" / "qwen3-moe-lora"
# families whose experts are adapted as Qwen3-MoE's are: (base, PEFT adapter, its target_modules)
EXPERT_FAMILIES = {
    "gpt_oss": (FIXTURES / "hf" / "gpt_oss", FIXTURES / "peft" / "gpt-oss-lora", ("q_proj",)),
    "deepseek_v3": (FIXTURES / "hf" / "deepseek_v3", FIXTURES / "peft" / "deepseek-v3-lora", ("o_proj", "q_b_proj")),
}
EXPERT_PARAMETERS = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def flat(tree):
    return traverse_util.flatten_dict(dict(tree), sep="/")


def tokens(rows=2, length=12, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 128, size=(rows, length)), jnp.int32)


def perturbed(adapted, seed=1, scale=0.2):
    """The adapted bundle's variables with every factor moved off its start (B off zero)."""
    leaves, tree = jax.tree_util.tree_flatten(adapted.variables["params"])
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return {**adapted.variables, "params": jax.tree_util.tree_unflatten(tree, moved)}  # base (and balance) as loaded


def lm_data(seq_len=8, rows=4):
    rng = np.random.default_rng(0)
    text = rng.integers(3, 128, size=(rows * 4, seq_len + 1)).astype(np.int32)
    return Dataset.from_records({"text": text}, batch=rows)


# --- adapting ----------------------------------------------------------------------------------


def test_a_fresh_adapter_starts_as_its_base_with_factors_in_the_kernel_layout():
    base = Pretrained.load(QWEN3)
    adapted = base.adapt(LoRA(rank=4, modules=("q_proj", "v_proj")), key=0)
    factors = flat(adapted.variables["params"])
    assert sorted(factors) == sorted(
        f"layers_{i}/self_attn/{m}/lora_{f}" for i in range(2) for m in ("q_proj", "v_proj") for f in "AB")
    assert factors["layers_0/self_attn/v_proj/lora_A"].shape == (64, 4)   # [in, rank]
    assert factors["layers_0/self_attn/v_proj/lora_B"].shape == (4, 32)   # [rank, out]
    assert not np.any(factors["layers_0/self_attn/v_proj/lora_B"])
    ids = tokens()
    np.testing.assert_array_equal(adapted.model.apply(adapted.variables, ids), base.model.apply(base.variables, ids))


def test_merged_weights_compute_what_the_adapter_does():
    base = Pretrained.load(LLAMA)
    adapted = base.adapt(LoRA(rank=4, alpha=8, modules=ALL_PROJECTIONS), key=0)
    variables = perturbed(adapted)
    ids = tokens()
    with_adapter = adapted.model.apply(variables, ids)
    merged = adapted.merge(variables)
    np.testing.assert_allclose(merged.model.apply(merged.variables, ids), with_adapter, atol=1e-5)
    # the adapter changes the function, so the match above is not the base matching itself
    assert np.abs(with_adapter - base.model.apply(base.variables, ids)).max() > 0.1


def test_a_scanned_base_computes_what_the_layered_one_does():
    layered = Pretrained.load(LLAMA).adapt(LoRA(rank=4, alpha=8, modules=ALL_PROJECTIONS), key=0)
    scanned = Pretrained.load(LLAMA, scan_layers=True).adapt(LoRA(rank=4, alpha=8, modules=ALL_PROJECTIONS), key=0)
    variables = perturbed(layered)
    layers = flat(variables["params"])
    stacked = {}
    for path in flat(scanned.variables["params"]):
        rest = path.split("/", 1)[1]
        stacked[path] = jnp.stack([layers[f"layers_{i}/{rest}"] for i in range(2)])
    scanned_variables = {"params": traverse_util.unflatten_dict(stacked, sep="/"), "base": scanned.variables["base"]}
    ids = tokens()
    np.testing.assert_allclose(scanned.model.apply(scanned_variables, ids), layered.model.apply(variables, ids),
                               atol=1e-5)


def test_dropout_acts_only_when_the_model_is_given_a_dropout_key():
    adapted = Pretrained.load(QWEN3).adapt(LoRA(rank=4, dropout=0.5, modules=("q_proj",)), key=0)
    variables = perturbed(adapted)
    ids = tokens()
    plain = adapted.model.apply(variables, ids)
    np.testing.assert_array_equal(plain, adapted.model.apply(variables, ids))
    dropped = adapted.model.apply(variables, ids, rngs={"dropout": jax.random.key(3)})
    assert np.abs(dropped - plain).max() > 1e-3


# --- training ----------------------------------------------------------------------------------


def test_training_changes_only_the_factors_and_the_optimizer_holds_only_factors():
    base = Pretrained.load(QWEN3)
    adapted = base.adapt(LoRA(rank=4, alpha=8, modules=("q_proj", "v_proj", "down_proj")), key=0)
    objective = LMObjective(adapted, seq_len=8)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.fit(lm_data(), steps=4, log_every=4)

    for path, value in flat(state.variables["base"]).items():
        np.testing.assert_array_equal(value, flat(base.variables["params"])[path], err_msg=path)
    before, after = flat(adapted.variables["params"]), flat(state.variables["params"])
    assert all(np.abs(after[p] - before[p]).max() > 0 for p in before)  # A and B both move
    factor_shapes = {np.shape(v) for v in before.values()}
    opt_shapes = {np.shape(leaf) for leaf in jax.tree_util.tree_leaves(state.opt_state) if np.ndim(leaf)}
    assert opt_shapes and opt_shapes <= factor_shapes, opt_shapes
    optimizer_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.opt_state))
    assert optimizer_bytes < 2 * sum(v.nbytes for v in before.values()) + 64

    ids = tokens()
    merged = adapted.merge(state.variables)
    np.testing.assert_allclose(merged.model.apply(merged.variables, ids),
                               adapted.model.apply(state.variables, ids), atol=1e-5)


def test_a_bfloat16_base_stays_frozen_while_float32_factors_train():
    base = Pretrained.load(QWEN3, param_dtype=jnp.bfloat16)
    adapted = base.adapt(LoRA(rank=4, modules=("q_proj", "v_proj")), key=0)
    state = Trainer(LMObjective(adapted, seq_len=8), optax.adam(1e-2), key=jax.random.key(0)).fit(
        lm_data(), steps=2, log_every=2)
    assert {v.dtype for v in flat(state.variables["base"]).values()} == {jnp.dtype(jnp.bfloat16)}
    assert {v.dtype for v in flat(state.variables["params"]).values()} == {jnp.dtype(jnp.float32)}
    for path, value in flat(state.variables["base"]).items():
        np.testing.assert_array_equal(value, flat(base.variables["params"])[path])


def test_checkpoints_hold_the_factors_alone_and_a_resumed_run_continues_exactly(tmp_path):
    def trainer(directory):
        adapted = Pretrained.load(QWEN3).adapt(LoRA(rank=2, modules=("q_proj",)), key=0)
        return Trainer(LMObjective(adapted, seq_len=8), optax.adam(1e-2), key=jax.random.key(0),
                       checkpoints=Checkpoints(directory))

    def grain_data():
        import grain.python as grain

        rng = np.random.default_rng(0)
        batches = [{"text": rng.integers(3, 128, size=(4, 9)).astype(np.int32)} for _ in range(4)]
        stream = grain.MapDataset.source(batches).repeat()
        return Dataset(train=lambda partition: iter(stream.to_iter_dataset()), val=None, records=16, batch=4)

    interrupted = trainer(tmp_path / "a")
    interrupted.fit(grain_data(), steps=2, log_every=2, checkpoint_every=2)
    variables, _, _ = Checkpoints(tmp_path / "a").restore_variables()
    assert sorted(variables) == ["params"]  # the frozen base is not in the checkpoint
    assert sorted(flat(variables["params"])) == [f"layers_{i}/self_attn/q_proj/lora_{f}" for i in range(2) for f in "AB"]
    resumed = interrupted.fit(grain_data(), steps=4, log_every=2, checkpoint_every=2)  # restores step 2
    straight = trainer(tmp_path / "b").fit(grain_data(), steps=4, log_every=2, checkpoint_every=2)
    for path, value in flat(straight.variables["params"]).items():
        np.testing.assert_array_equal(flat(resumed.variables["params"])[path], value)
    for path, value in flat(Pretrained.load(QWEN3).variables["params"]).items():
        np.testing.assert_array_equal(flat(resumed.variables["base"])[path], value)


# --- PEFT's format -----------------------------------------------------------------------------


def test_a_peft_trained_adapter_loads_with_peft_logits_and_the_controls_fail():
    reference = np.load(PEFT_ADAPTER / "reference.npz")
    ids = reference["input_ids"]
    lora = LoRA.load(PEFT_ADAPTER)
    assert (lora.rank, lora.scaling, lora.modules) == (4, 2.0, tuple(sorted(ALL_PROJECTIONS)))
    adapted = Pretrained.load(LLAMA).adapt(lora)  # trained factors: no key to draw with
    logits = np.asarray(adapted.model.apply(adapted.variables, ids))
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4)
    assert np.abs(reference["logits"] - reference["base_logits"]).max() > 1.0

    # negative controls: the scale left out, and A and B swapped (read without the transpose)
    unscaled = Pretrained.load(LLAMA).adapt(LoRA.load(PEFT_ADAPTER), key=0)
    unscaled = unscaled.model.__class__(unscaled.model.model, LoRA(rank=4, alpha=4, modules=ALL_PROJECTIONS),
                                        unscaled.model.targets)
    assert np.abs(unscaled.apply(adapted.variables, ids) - reference["logits"]).max() > 1e-2
    factors = flat(adapted.variables["params"])
    swapped = {}
    for path, value in factors.items():  # B^T A^T on the square projections: the roles mixed up
        module, factor = path.rsplit("/", 1)
        other = factors[f"{module}/lora_{'B' if factor == 'lora_A' else 'A'}"]
        swapped[path] = other.T if other.T.shape == value.shape else value
    swapped_variables = {"params": traverse_util.unflatten_dict(swapped, sep="/"), "base": adapted.variables["base"]}
    assert np.abs(adapted.model.apply(swapped_variables, ids) - reference["logits"]).max() > 1e-2


def test_a_peft_adapter_on_stacked_experts_loads_with_peft_logits_and_the_controls_fail(monkeypatch):
    """q_proj plus the experts' gate_up_proj and down_proj (PEFT's target_parameters) on a
    Qwen3-MoE whose middle layer is dense: Dew reads PEFT's expert-major A and expert-minor B."""
    from dew.interop import adapted as adapted_module

    reference = np.load(MOE_ADAPTER / "reference.npz")
    ids = reference["input_ids"]
    lora = LoRA.load(MOE_ADAPTER)
    assert (lora.rank, lora.scaling, lora.modules, lora.parameters) == (2, 3.0, ("q_proj",), EXPERT_PARAMETERS)
    adapted = Pretrained.load(QWEN3_MOE).adapt(lora)
    assert [p.name for p in adapted.parameters] == [f"model.layers.{i}.{n}" for i in (0, 2) for n in reversed(EXPERT_PARAMETERS)]
    assert flat(adapted.variables["params"])["layers_0/mlp/experts/gate_up_proj/lora_A"].shape == (8, 32, 2)
    np.testing.assert_allclose(adapted.model.apply(adapted.variables, ids), reference["logits"], atol=1e-4)
    np.testing.assert_allclose(adapted.merge().model.apply(adapted.merge().variables, ids), reference["logits"], atol=1e-4)
    assert np.abs(reference["logits"] - reference["base_logits"]).max() > 1.0

    # negative controls: A read expert-minor (as B is), and gate and up swapped within gate_up_proj
    right = adapted_module._experts_from_peft

    def expert_minor_a(a, b, experts, rank):
        _, good_b = right(a, b, experts, rank)
        return a.reshape(rank, experts, a.shape[-1]).transpose(1, 2, 0), good_b

    with monkeypatch.context() as patch:
        patch.setattr(adapted_module, "_experts_from_peft", expert_minor_a)
        wrong = Pretrained.load(QWEN3_MOE).adapt(LoRA.load(MOE_ADAPTER))
    assert np.abs(wrong.model.apply(wrong.variables, ids) - reference["logits"]).max() > 1e-2
    swapped = adapted.model.__class__(adapted.model.model, adapted.model.lora, adapted.model.targets,
                                      experts=[(path, kernels[::-1]) for path, kernels in adapted.model.experts])
    assert np.abs(swapped.apply(adapted.variables, ids) - reference["logits"]).max() > 1e-2


@pytest.mark.parametrize("family", sorted(EXPERT_FAMILIES))
def test_peft_expert_adapters_load_on_gpt_oss_and_deepseek_with_peft_logits(monkeypatch, family):
    """GPT-OSS's fused, interleaved gate_up_proj [experts, in, out] and DeepSeek-V3's routed experts
    (its first layer dense), each with attention projections, against PEFT's logits."""
    from dew.interop import adapted as adapted_module

    base, adapter, modules = EXPERT_FAMILIES[family]
    reference = np.load(adapter / "reference.npz")
    ids = reference["input_ids"]
    lora = LoRA.load(adapter)
    assert (lora.modules, lora.parameters) == (modules, EXPERT_PARAMETERS)
    adapted = Pretrained.load(base).adapt(lora)
    layers = sorted({int(p.name.split(".")[2]) for p in adapted.parameters})
    assert layers == ([0, 1] if family == "gpt_oss" else [1, 2])
    np.testing.assert_allclose(adapted.model.apply(adapted.variables, ids), reference["logits"], atol=1e-4)
    merged = adapted.merge()
    np.testing.assert_allclose(merged.model.apply(merged.variables, ids), reference["logits"], atol=1e-4)
    assert np.abs(reference["logits"] - reference["base_logits"]).max() > 1.0

    right = adapted_module._experts_from_peft  # negative control: A read expert-minor, as B is

    def expert_minor_a(a, b, experts, rank):
        return a.reshape(rank, experts, a.shape[-1]).transpose(1, 2, 0), right(a, b, experts, rank)[1]

    with monkeypatch.context() as patch:
        patch.setattr(adapted_module, "_experts_from_peft", expert_minor_a)
        wrong = Pretrained.load(base).adapt(LoRA.load(adapter))
    assert np.abs(wrong.model.apply(wrong.variables, ids) - reference["logits"]).max() > 1e-2


def test_expert_adapters_save_as_peft_does_and_train_alone(tmp_path):
    base = Pretrained.load(QWEN3_MOE)
    adapted = base.adapt(LoRA(rank=2, alpha=6, modules=("q_proj",), parameters=("gate_up_proj", "down_proj")), key=0)
    variables = perturbed(adapted)
    adapted.save_adapter(tmp_path / "adapter", variables)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == list(EXPERT_PARAMETERS) and config["target_modules"] == ["q_proj"]
    ours = SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors")
    peft_made = SafetensorsFile(MOE_ADAPTER / "adapter_model.safetensors")
    assert {name: ours.shape(name) for name in ours} == {name: peft_made.shape(name) for name in peft_made}
    loaded = base.adapt(LoRA.load(tmp_path / "adapter", check_base=False))
    ids = tokens()
    np.testing.assert_array_equal(loaded.model.apply(loaded.variables, ids), adapted.model.apply(variables, ids))

    # training moves the factors alone; the expert kernels stay bit-identical
    objective = LMObjective(adapted, seq_len=8)
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0)).fit(lm_data(), steps=2, log_every=2)
    trained = flat(state.variables["params"])
    assert all(not np.array_equal(trained[k], v) for k, v in flat(adapted.variables["params"]).items() if k.endswith("lora_B"))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.variables["base"]),
                                                     jax.tree.leaves(adapted.variables["base"])))
    with pytest.raises(ValueError, match="dropout=0.1 cannot act on expert parameters"):
        base.adapt(LoRA(rank=2, dropout=0.1, parameters=("gate_up_proj",), modules=()), key=0)


def test_expert_parameters_that_match_nothing_or_overflow_raise():
    with pytest.raises(ValueError, match=r"'mlp.experts.gate_up_proj' adapts nothing: the llama family has no stacked expert parameters"):
        Pretrained.load(LLAMA).adapt(LoRA(rank=2, parameters=("mlp.experts.gate_up_proj",)), key=0)
    with pytest.raises(ValueError, match=r"'experts.w1' adapts nothing: it matches none of this model's"):
        Pretrained.load(QWEN3_MOE).adapt(LoRA(rank=2, modules=(), parameters=("experts.w1",)), key=0)
    with pytest.raises(ValueError, match=r"rank=20 is larger than the expert parameter model.layers.0.mlp.experts.down_proj"):
        Pretrained.load(QWEN3_MOE).adapt(LoRA(rank=20, modules=(), parameters=("down_proj",)), key=0)
    with pytest.raises(ValueError, match="adapts nothing: modules and parameters are both empty"):
        LoRA(rank=2, modules=())


def test_save_adapter_writes_peft_names_shapes_and_config_and_loads_back(tmp_path):
    adapted = Pretrained.load(QWEN3).adapt(LoRA(rank=4, alpha=16, modules=("q_proj", "v_proj")), key=0)
    variables = perturbed(adapted)
    adapted.save_adapter(tmp_path / "adapter", variables)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 16, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str(QWEN3) and config["peft_type"] == "LORA"
    tensors = SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors")
    assert tensors.shape("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight") == (4, 64)
    assert tensors.shape("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight") == (32, 4)
    np.testing.assert_array_equal(tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"],
                                  np.asarray(variables["params"]["layers_1"]["self_attn"]["v_proj"]["lora_B"]).T)
    assert len(tensors) == 8

    loaded = Pretrained.load(QWEN3).adapt(LoRA.load(tmp_path / "adapter"), key=5)
    ids = tokens()
    np.testing.assert_array_equal(loaded.model.apply(loaded.variables, ids), adapted.model.apply(variables, ids))
    with pytest.raises(FileExistsError, match="not empty"):
        adapted.save_adapter(tmp_path / "adapter")


def test_target_modules_name_single_layers_when_only_some_are_adapted(tmp_path):
    lora = LoRA(rank=2, modules=r"model\.layers\.1\.mlp\.(up|down)_proj")
    adapted = Pretrained.load(QWEN3).adapt(lora, key=0)
    assert sorted(flat(adapted.variables["params"])) == [f"layers_1/mlp/{m}/lora_{f}" for m in ("down_proj", "up_proj") for f in "AB"]
    adapted.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"]


# --- bad input ---------------------------------------------------------------------------------


def test_adapting_twice_without_merging_raises():
    adapted = Pretrained.load(QWEN3).adapt(LoRA(rank=2), key=0)
    with pytest.raises(ValueError, match="already carries a LoRA adapter.*merge"):
        adapted.adapt(LoRA(rank=2), key=1)
    twice = adapted.merge().adapt(LoRA(rank=2), key=1)  # merging first is the way
    assert sorted(twice.variables) == ["base", "params"]


def test_a_rank_larger_than_a_projection_raises_naming_it():
    with pytest.raises(ValueError, match=r"rank=40 is larger than the projection model.layers.0.self_attn.v_proj \(\[in, out\] = \[64, 32\]\)"):
        Pretrained.load(QWEN3).adapt(LoRA(rank=40, modules=("q_proj", "v_proj")), key=0)


def test_unknown_or_unmatched_module_names_raise_with_the_projection_list():
    base = Pretrained.load(QWEN3)
    with pytest.raises(ValueError, match=r"'qproj' is not a projection name; the qwen3 projections are \['down_proj', 'gate_proj', 'k_proj', 'lm_head'"):
        base.adapt(LoRA(rank=2, modules=("q_proj", "qproj")), key=0)
    with pytest.raises(ValueError, match="'lm_head' matches no module of this model"):  # the head is tied
        base.adapt(LoRA(rank=2, modules=("lm_head",)), key=0)
    with pytest.raises(ValueError, match="matches no linear module"):
        base.adapt(LoRA(rank=2, modules=r".*\.attn\.q_proj"), key=0)


def test_an_adapter_for_another_base_raises_saying_what_differs(tmp_path):
    with pytest.raises(ValueError, match="made for base 'tests/fixtures/hf/llama'.*check_base=False"):
        Pretrained.load(QWEN3).adapt(LoRA.load(PEFT_ADAPTER), key=0)
    # another base of the same name: the shapes tell
    lora = LoRA.load(PEFT_ADAPTER)
    narrow = Pretrained.load(FIXTURES / "hf" / "qwen3-sliding")
    with pytest.raises(ValueError, match=r"adapter tensor .*layers.0.self_attn.q_proj.lora_A.weight.* has shape \[4, 64\].*\[in, out\] = \[32, 32\]\) at rank 4 needs \[4, 32\]"):
        narrow.adapt(LoRA.load(PEFT_ADAPTER, check_base=False), key=0)
    # an adapter covering modules the base does not take
    tensors = dict(SafetensorsFile(PEFT_ADAPTER / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 64), np.float32)
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "adapter_config.json").write_text((PEFT_ADAPTER / "adapter_config.json").read_text())
    save_file(tensors, tmp_path / "extra" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"has tensors this base does not take \['base_model.model.model.layers.5"):
        Pretrained.load(LLAMA).adapt(LoRA.load(tmp_path / "extra"), key=0)
    assert lora.base == "tests/fixtures/hf/llama"


@pytest.mark.parametrize("option, value", [("use_dora", True), ("use_rslora", True), ("rank_pattern", {"q_proj": 8}),
                                           ("bias", "all"), ("init_lora_weights", "pissa")])
def test_a_peft_option_dew_does_not_implement_raises(tmp_path, option, value):
    config = json.loads((PEFT_ADAPTER / "adapter_config.json").read_text())
    config[option] = value
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes((PEFT_ADAPTER / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=option):
        LoRA.load(tmp_path)


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="needs key="):
        Pretrained.load(QWEN3).adapt(LoRA(rank=2))
    with pytest.raises(ValueError, match="LoRA rank must be a positive integer"):
        LoRA(rank=0)
    with pytest.raises(ValueError, match="dropout must be a probability"):
        LoRA(rank=2, dropout=1.0)
    with pytest.raises(ValueError, match="init must be one of"):
        LoRA(rank=2, init="zeros")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        LoRA.load(LLAMA)


@pytest.mark.reference
def test_an_adapter_saved_by_dew_gives_dews_logits_in_peft(tmp_path):
    import peft
    import torch
    import transformers

    adapted = Pretrained.load(QWEN3).adapt(LoRA(rank=4, alpha=8, modules=ALL_PROJECTIONS), key=0)
    variables = perturbed(adapted)
    adapted.save_adapter(tmp_path / "adapter", variables)
    ids = tokens()
    expected = np.asarray(adapted.model.apply(variables, ids))

    model = transformers.AutoModelForCausalLM.from_pretrained(QWEN3, dtype=torch.float32, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    with torch.no_grad():
        logits = with_adapter(input_ids=torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()
        with with_adapter.disable_adapter():
            base_logits = with_adapter(input_ids=torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    assert np.abs(base_logits - expected).max() > 1e-2  # the adapter was applied, not ignored


@pytest.mark.reference
@pytest.mark.parametrize("base", [QWEN3_MOE, EXPERT_FAMILIES["gpt_oss"][0], EXPERT_FAMILIES["deepseek_v3"][0]],
                         ids=["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_an_expert_adapter_saved_by_dew_gives_dews_logits_in_peft(tmp_path, base):
    import peft
    import torch
    import transformers

    adapted = Pretrained.load(base).adapt(
        LoRA(rank=2, alpha=4, modules=("o_proj",), parameters=EXPERT_PARAMETERS), key=0)
    variables = perturbed(adapted)
    adapted.save_adapter(tmp_path / "adapter", variables)
    ids = tokens()
    expected = np.asarray(adapted.model.apply(variables, ids))
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    with torch.no_grad():
        logits = with_adapter(input_ids=torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)


# --- post-training on an adapted bundle ----------------------------------------------------------


def preference_data(seq_len=11, rows=4):
    """Pairs of token rows sharing a 4-token prompt; the masks mark the responses."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 128, size=(rows, 4))
    chosen = np.concatenate([prompt, rng.integers(3, 128, size=(rows, seq_len - 3))], axis=1).astype(np.int32)
    rejected = np.concatenate([prompt, rng.integers(3, 128, size=(rows, seq_len - 3))], axis=1).astype(np.int32)
    mask = np.concatenate([np.zeros((rows, 4)), np.ones((rows, seq_len - 3))], axis=1).astype(np.int32)
    return {"chosen": chosen, "rejected": rejected, "chosen_mask": mask, "rejected_mask": mask}


def test_dpo_on_an_adapted_bundle_takes_the_base_as_its_reference_without_a_copy():
    from dew.objectives.rl import DPOObjective

    base = Pretrained.load(QWEN3)
    adapted = base.adapt(LoRA(rank=4, alpha=8, modules=("q_proj", "v_proj")), key=0)
    objective = DPOObjective(adapted, seq_len=11, beta=0.1)
    columns = preference_data()
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records(columns, batch=4), steps=6, log_every=6)
    assert sorted(state.variables) == ["base", "params"]  # no "reference" collection

    batch = {k: jnp.asarray(v) for k, v in columns.items()}
    policy, reference = jax.jit(objective.sequence_log_probs)(state.variables, batch)
    base_policy, _ = jax.jit(DPOObjective(base, seq_len=11).sequence_log_probs)(
        {**base.variables, "reference": base.variables["params"]}, batch)
    np.testing.assert_allclose(np.asarray(reference), np.asarray(base_policy), rtol=1e-5)  # adapter off
    rows = columns["chosen"].shape[0]
    margin = np.asarray(policy[:rows] - policy[rows:]) - np.asarray(reference[:rows] - reference[rows:])
    assert margin.mean() > 0.5  # the adapter learned to prefer the chosen responses
    for path, value in flat(state.variables["base"]).items():
        np.testing.assert_array_equal(value, flat(base.variables["params"])[path])


def test_adapted_dpo_needs_about_one_model_less_memory_than_full_dpo():
    from dew.objectives.rl import DPOObjective

    base = Pretrained.load(QWEN3)
    batch = {k: jnp.asarray(v) for k, v in preference_data().items()}

    def compiled_bytes(objective):
        trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0))
        state = trainer.init_state()
        analysis = trainer.compiled_step().lower(state, trainer.place(batch)).compile().memory_analysis()
        return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes

    weights = sum(v.nbytes for v in flat(base.variables["params"]).values())
    full = compiled_bytes(DPOObjective(base, seq_len=11))
    adapted = compiled_bytes(DPOObjective(base.adapt(LoRA(rank=4, modules=("q_proj", "v_proj")), key=0), seq_len=11))
    print(f"compiled DPO step: full {full} bytes, adapted {adapted} bytes, weights {weights} bytes")
    assert full - adapted > weights, (full, adapted, weights)


def test_grpo_samples_from_the_adapted_policy_and_scores_against_the_base():
    from dew.objectives.base import Step
    from dew.objectives.rl import GRPOObjective, SampledRollout
    from dew.sampling import Sampling

    base = Pretrained.load(QWEN3)
    adapted = base.adapt(LoRA(rank=4, modules=("q_proj",)), key=0)
    objective = GRPOObjective(adapted, seq_len=12, beta=0.1)
    assert sorted(objective.init(None, adapted.variables)) == ["base", "params"]  # no reference copy
    variables = perturbed(adapted)

    rollout = SampledRollout(objective, reward=lambda source, completion, truth, extra: float(len(completion)),
                             groups=2, max_new_tokens=4, sampling=Sampling(temperature=1.0),
                             decode=lambda ids: " ".join(map(str, ids)))
    prompts = {"prompt": np.array([[5, 6, 7]] * 2, np.int32), "prompt_length": np.full(2, 3, np.int32),
               "data_source": np.tile(np.frombuffer(b"toy", np.uint8).astype(np.int32), (2, 1)),
               "ground_truth": np.zeros((2, 0), np.int32), "extra_info": np.zeros((2, 0), np.int32)}
    batch = {k: jnp.asarray(v) for k, v in rollout(variables, prompts, jax.random.key(1)).items()}
    mask = np.asarray(batch["response_mask"][:, 1:]) == 1
    logp, reference, base_logp, loss = jax.jit(lambda v, b, text: (
        objective.token_log_probs(v, text), objective.reference_log_probs(v, text),
        objective.token_log_probs(base.variables, text, model=base.model),
        objective.loss(v, b, Step(0, jax.random.key(2)))[0]))(variables, batch, batch["text"])
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(batch["old_log_probs"][:, 1:])[mask], atol=1e-4)
    np.testing.assert_allclose(np.asarray(reference), np.asarray(base_logp), atol=1e-5)
    assert np.abs(np.asarray(reference) - np.asarray(logp))[mask].max() > 1e-3
    assert np.isfinite(float(loss))


# --- adapted runs ------------------------------------------------------------------------------


@pytest.mark.parametrize("base, lora", [
    (QWEN3, LoRA(rank=2, alpha=4, modules=("q_proj", "o_proj"))),
    (QWEN3_MOE, LoRA(rank=2, alpha=4, modules=("o_proj",), parameters=EXPERT_PARAMETERS)),
], ids=["projections", "experts"])
def test_an_adapted_run_records_its_base_and_exports_as_an_adapter_or_merged(tmp_path, base, lora):
    import dew
    from dew.cli.main import main as dew_main
    from dew.config.run import ModelConfig, ObjectiveConfig, RunConfig

    run = tmp_path / "run"
    adapted = Pretrained.load(base).adapt(lora, key=0)
    objective = LMObjective(adapted, seq_len=8)
    checkpoints = Checkpoints(run)
    import grain.python as grain

    batches = [{"text": np.random.default_rng(0).integers(3, 128, size=(4, 9)).astype(np.int32)}]
    stream = grain.MapDataset.source(batches).repeat()
    data = Dataset(train=lambda partition: iter(stream.to_iter_dataset()), val=None, records=4, batch=4)
    state = Trainer(objective, optax.adam(3e-2), key=jax.random.key(0), checkpoints=checkpoints).fit(
        data, steps=3, log_every=3, checkpoint_every=3)
    RunConfig(model=ModelConfig.from_model(adapted.model), objective=ObjectiveConfig.from_objective(objective)).save(run)
    record = json.loads((run / "run.json").read_text())
    assert record["model"]["settings"]["base"] == str(base)  # referenced, not copied

    ids = tokens()
    expected = np.asarray(adapted.model.apply(state.variables, ids))
    dew_main(["export", str(run), str(tmp_path / "adapter"), "--live"])
    loaded = Pretrained.load(base).adapt(LoRA.load(tmp_path / "adapter"), key=0)
    np.testing.assert_allclose(loaded.model.apply(loaded.variables, ids), expected, atol=1e-6)

    dew_main(["export", str(run), str(tmp_path / "merged"), "--live", "--merged"])
    merged = Pretrained.load(tmp_path / "merged")
    np.testing.assert_allclose(merged.model.apply(merged.variables, ids), expected, atol=1e-5)
    assert np.abs(expected - np.asarray(Pretrained.load(base).model.apply(Pretrained.load(base).variables, ids))).max() > 1e-3

    task = dew.pipeline(run, ema=False)  # the base is loaded again from where run.json names it
    np.testing.assert_allclose(task.model.apply(task.variables, ids), expected, atol=1e-6)
