"""Qwen2, Mixtral and Qwen3-MoE checkpoints: parity with transformers, training, export, bad input.

The fixtures under tests/fixtures/hf/{qwen2,mixtral,qwen3_moe} come from
tools/hf_decoder_fixtures.py: tiny random models keeping the released structure (Qwen2.5's q/k/v
biases and head split, Mixtral's top-2 of 8 renormalized experts, Qwen3-30B-A3B's renormalized
top-k with a dense layer from mlp_only_layers), with transformers' logits, greedy continuation
and, for the mixtures, the load-balancing loss transformers reports.
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

from dew.interop import Pretrained, PretrainedDecoder
from dew.interop.families import qwen3_moe
from dew.interop.safetensors_io import SafetensorsFile
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.moe import router_metrics
from hf_reference import FIXTURES, TOLERANCE, far, logits, moved_variables, reference, transformers_reads

NAMES = ["qwen2", "mixtral", "qwen3_moe"]


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedDecoder.load(FIXTURES / name) for name in NAMES}


# --- parity with transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_loaded_checkpoint_matches_transformers_logits_and_greedy_tokens(loaded, name):
    bundle, ref = loaded[name], reference(name)
    np.testing.assert_allclose(logits(bundle.model, bundle.variables, ref["input_ids"]), ref["logits"],
                               atol=TOLERANCE, rtol=0)
    result = bundle.text_generation()(ref["prompt"], ref["greedy"].shape[1], key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, ref["greedy"])


def test_one_row_decodes_a_mixture_from_the_decode_layout_as_transformers_does(loaded):
    bundle, ref = loaded["mixtral"], reference("mixtral")
    result = bundle.text_generation()(ref["prompt"][1:], ref["greedy"].shape[1], key=jax.random.key(0)).host()
    np.testing.assert_array_equal(result.tokens, ref["greedy"][1:])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_load_balancing_loss_is_the_one_transformers_reports(loaded, name):
    bundle, ref = loaded[name], reference(name)
    _, recorded = bundle.model.apply(bundle.variables, jnp.asarray(ref["input_ids"]), mutable=["router"])
    balance = float(router_metrics(recorded["router"])["balance"])
    np.testing.assert_allclose(balance, float(ref["aux_loss"]), rtol=1e-5)
    # negative control: the same layers routed to one more expert report another loss
    top_k = bundle.model.mixture["top_k"]
    other = bundle.model.clone(mixture={**bundle.model.mixture, "top_k": top_k + 1})
    _, recorded = other.apply(bundle.variables, jnp.asarray(ref["input_ids"]), mutable=["router"])
    assert abs(float(router_metrics(recorded["router"])["balance"]) - float(ref["aux_loss"])) > 1e-2


def test_the_comparison_catches_a_wrong_router_a_missing_bias_and_a_wrong_layer_plan(loaded):
    """Negative controls: each mistake a loader could make moves the logits far past the tolerance."""
    qwen2, ref = loaded["qwen2"], reference("qwen2")
    without = jax.tree_util.tree_map(lambda x: x, nn.unbox(qwen2.variables)["params"])
    for layer in ("layers_0", "layers_1"):
        for projection in ("q_proj", "k_proj", "v_proj"):
            bias = without[layer]["self_attn"][projection]["bias"]
            without[layer]["self_attn"][projection]["bias"] = jnp.zeros_like(bias)
    assert far(logits(qwen2.model, {"params": without}, ref["input_ids"]), ref["logits"])

    mixtral, ref = loaded["mixtral"], reference("mixtral")
    for change in ({"top_k": 1}, {"top_k": 3}, {"normalize_top_k": False}):
        wrong = mixtral.model.clone(mixture={**mixtral.model.mixture, **change})
        assert far(logits(wrong, mixtral.variables, ref["input_ids"]), ref["logits"]), change

    moe, ref = loaded["qwen3_moe"], reference("qwen3_moe")
    unnormalized = moe.model.clone(mixture={**moe.model.mixture, "normalize_top_k": False})
    assert far(logits(unnormalized, moe.variables, ref["input_ids"]), ref["logits"])
    # the router's rows are the experts: swapping two experts' weights (not the router's) moves the logits
    swapped = jax.tree_util.tree_map(lambda x: x, nn.unbox(moe.variables)["params"])
    experts = swapped["layers_2"]["mlp"]["experts"]
    experts["down_proj"] = experts["down_proj"][jnp.asarray([1, 0, 2, 3, 4, 5, 6, 7])]
    assert far(logits(moe.model, {"params": swapped}, ref["input_ids"]), ref["logits"])


def test_loading_translates_the_configs(loaded):
    qwen2, mixtral, moe = (loaded[name].model for name in NAMES)
    assert (qwen2.qkv_bias, qwen2.attention_bias, qwen2.qk_norm, qwen2.tie_embeddings) == (True, False, False, True)
    assert (qwen2.num_heads, qwen2.kv_heads, qwen2.head_features) == (7, 1, 8)
    assert dict(mixtral.mixture) == dict(num_experts=8, top_k=2, expert_features=24, normalize_top_k=True)
    assert mixtral.mlp_plan == ("mixture", "mixture") and not mixtral.qk_norm
    assert moe.mlp_plan == ("mixture", "dense", "mixture") and moe.qk_norm
    assert dict(moe.mixture) == dict(num_experts=8, top_k=3, expert_features=16, normalize_top_k=True)
    assert moe.hidden_features == 48  # the dense layer's width
    assert isinstance(Pretrained.load(FIXTURES / "mixtral"), PretrainedDecoder)


@pytest.mark.parametrize(
    "settings, plan",
    [
        (dict(decoder_sparse_step=2, mlp_only_layers=[]), ("dense", "mixture", "dense", "mixture")),
        (dict(decoder_sparse_step=1, mlp_only_layers=[0, 3]), ("dense", "mixture", "mixture", "dense")),
        (dict(decoder_sparse_step=1, num_experts=0), ("dense",) * 4),
    ],
)
def test_qwen3_moe_layer_plans_follow_decoder_sparse_step_and_mlp_only_layers(settings, plan):
    config = {**json.loads((FIXTURES / "qwen3_moe/config.json").read_text()), "num_hidden_layers": 4}
    config.pop("num_local_experts", None)
    config.update({"num_experts": 8, **settings})
    kwargs = qwen3_moe.model_kwargs(config)
    model = CausalTransformer(**kwargs)
    assert model.mlp_plan == plan
    assert (model.mixture is None) == ("mixture" not in plan)


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
    assert config["model_type"] == name
    for key in ("num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "num_local_experts",
                "mlp_only_layers", "decoder_sparse_step", "tie_word_embeddings", "num_key_value_heads"):
        if key in source and key != "num_local_experts":
            assert config[key] == source[key], key
    again = PretrainedDecoder.load(out)
    assert again.model == loaded[name].model


@pytest.mark.parametrize("name", NAMES)
def test_a_trainer_update_exports_and_reloads(tmp_path, loaded, name):
    from dew import Dataset, Trainer
    from dew.objectives.lm import LMObjective

    bundle = loaded[name]
    rows = np.random.default_rng(0).integers(3, 128, size=(8, 13)).astype(np.int32)
    objective = LMObjective(bundle, seq_len=12, balance_coef=0.001)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records({"text": rows}, batch=8), steps=1, log_every=1)
    trained = nn.unbox(state.variables)["params"]
    if bundle.model.mixture is not None:
        assert "router/balance" in trainer.history[-1]
        layer = trained["layers_0"]["mlp"]
        before = nn.unbox(bundle.variables)["params"]["layers_0"]["mlp"]
        assert not np.allclose(np.asarray(layer["gate"]), np.asarray(before["gate"]))
        assert not np.allclose(np.asarray(layer["experts"]["up_proj"]), np.asarray(before["experts"]["up_proj"]))
    out = bundle.save(tmp_path / "trained", variables=state.variables)
    again = PretrainedDecoder.load(out)
    ids = rows[:2, :12]
    np.testing.assert_array_equal(logits(again.model, again.variables, ids),
                                  logits(bundle.model, state.variables, ids))
    assert far(logits(again.model, again.variables, ids), logits(bundle.model, bundle.variables, ids))


def test_a_mixture_trained_in_dew_exports_as_qwen3_moe_or_mixtral(tmp_path):
    settings = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_features=40, max_seq_len=32, tie_embeddings=False,
                    mixture={"num_experts": 4, "top_k": 2, "expert_features": 16, "normalize_top_k": True})
    ids = np.arange(20, dtype=np.int32).reshape(2, 10) % 64
    for qk_norm, family, extra in ((True, "qwen3_moe", dict(first_k_dense=1)), (False, "mixtral", {})):
        model = CausalTransformer(**settings, qk_norm=qk_norm, **extra)
        variables = nn.unbox(model.init(jax.random.key(0), ids))
        out = PretrainedDecoder.from_model(model, variables).save(tmp_path / family)
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == family
        again = PretrainedDecoder.load(out)
        assert again.model.mlp_plan == model.mlp_plan
        np.testing.assert_array_equal(logits(again.model, again.variables, ids), logits(model, variables, ids))
    assert json.loads((tmp_path / "qwen3_moe/config.json").read_text())["mlp_only_layers"] == [0]


@pytest.mark.parametrize(
    "overrides, family, message",
    [
        (dict(mixture={"num_experts": 4, "top_k": 2, "expert_features": 16, "shared_expert_features": 8}), None,
         "shared_expert_features"),
        (dict(mixture={"num_experts": 4, "top_k": 2, "expert_features": 16}, qk_norm=False), None,
         "normalize_top_k"),
        (dict(mixture={"num_experts": 4, "top_k": 2, "expert_features": 16, "normalize_top_k": True},
              qk_norm=False, first_k_dense=1), None, "every layer is a mixture"),
        (dict(mixture={"num_experts": 4, "top_k": 2, "expert_features": 16}), "qwen3",
         "cannot be exported as qwen3"),
        (dict(qkv_bias=True), "llama", "exports as qwen2"),
    ],
)
def test_settings_a_family_cannot_express_are_refused(overrides, family, message):
    from dew.interop import families

    settings = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)
    model = CausalTransformer(**{**settings, **overrides})
    with pytest.raises(ValueError, match=message):
        if family is None:
            PretrainedDecoder.from_model(model, {"params": {}})
        else:
            families.DECODER_FAMILIES[family].hf_config(model)


def test_checkpoint_settings_dew_does_not_implement_are_named(tmp_path):
    directory = tmp_path / "mixtral"
    shutil.copytree(FIXTURES / "mixtral", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.1}))
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        PretrainedDecoder.load(directory)
    (directory / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="top_k=9 is larger than num_experts=8"):
        PretrainedDecoder.load(directory)
    (directory / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    with pytest.raises(ValueError, match="block_sparse_moe.experts.6|block_sparse_moe.gate.weight"):
        PretrainedDecoder.load(directory)


# --- live reference --------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES)
def test_transformers_reads_a_trained_export_with_the_same_logits(tmp_path, loaded, name):
    bundle = loaded[name]
    moved = moved_variables(bundle)
    out = bundle.save(tmp_path / "export", variables=moved)
    ids = (np.arange(20).reshape(2, 10) * 37 % 128).astype(np.int32)
    result = transformers_reads(out, ids)
    assert result["model_type"] == name
    want = logits(bundle.model, moved, ids)
    np.testing.assert_allclose(np.asarray(result["logits"]), want, atol=TOLERANCE, rtol=0)
    assert far(want, logits(bundle.model, bundle.variables, ids))
