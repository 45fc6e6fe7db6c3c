"""dew plan: per-device bytes and collectives of a compiled training step, without allocating weights."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from dew import MeshSpec
from dew.cli import plan as plan_command
from dew.cli.main import main
from dew.telemetry.collectives import count_collectives
from dew.training import Layout
from dew.training import plan as planning
from dew.training.plan import decoder, plan

VOCAB, EMBED, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 256, 64, 2, 4, 2, 16, 128
TINY = dict(vocab_size=VOCAB, emb_features=EMBED, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM, mlp_features=MLP, max_seq_len=64, qk_norm=False, tie_embeddings=True)
# Weight matrices (each splits over fsdp on its embed axis) and norm scales (always replicated).
MATRICES = VOCAB * EMBED + LAYERS * (
    EMBED * HEADS * HEAD_DIM + 2 * EMBED * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * EMBED + 3 * EMBED * MLP
)
NORMS = LAYERS * 2 * EMBED + EMBED


def tiny_plan(mesh, devices):
    model = decoder(TINY, seq_len=16, dtype=jnp.float32)
    return plan(model, mesh, devices=devices, batch=8, seq_len=16, layout=Layout(min_shard=1))


def test_fsdp_plan_reports_sharded_parameter_bytes_and_collectives():
    sharded = tiny_plan(MeshSpec(fsdp=4), devices=4)
    assert sharded.parameter_count == MATRICES + NORMS
    assert sharded.parameters == 4 * (MATRICES // 4 + NORMS)  # float32 weights, a quarter of each matrix
    assert 2 * sharded.parameters <= sharded.optimizer_state <= 2 * sharded.parameters + 64  # Adam's mu, nu, count
    assert sharded.batch == 2 * 17 * 4  # two of the eight int32 rows per device
    # The shares the shardings give add up to what XLA's memory analysis counts as the step's arguments.
    assert sharded.arguments == sharded.parameters + sharded.optimizer_state + sharded.other_state + sharded.batch
    assert sharded.aliased >= sharded.parameters + sharded.optimizer_state  # the state is donated
    assert 0 < sharded.activations < sharded.temporaries
    assert sharded.collectives["all-gather"].count > 0 and sharded.collectives["all-gather"].bytes > 0
    assert sharded.collectives["all-reduce"].count > 0
    assert "fsdp=4" in sharded.report() and "all-gather" in sharded.report()

    alone = tiny_plan(MeshSpec(), devices=1)  # the same step on one device: whole weights, no collectives
    assert alone.parameters == 4 * (MATRICES + NORMS)
    assert all(collective.count == 0 for collective in alone.collectives.kinds)


def test_plan_refuses_meshes_it_cannot_build():
    model = decoder(TINY, seq_len=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="needs a multiple of 3 devices, but 4"):
        plan(model, MeshSpec(fsdp=3), devices=4, batch=8, seq_len=16)
    present = len(jax.devices())
    with pytest.raises(ValueError, match=f"{present + 8} devices.*started with {present}.*device_count={present + 8}"):
        plan(model, MeshSpec(fsdp=present + 8), devices=present + 8, batch=8, seq_len=16)
    with pytest.raises(ValueError, match="batch=6 rows do not split over the 4 batch-parallel devices"):
        plan(model, MeshSpec(fsdp=2), devices=4, batch=6, seq_len=16)
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        plan(model, MeshSpec(), devices=0, batch=8, seq_len=16)


def test_plan_command_reads_a_config_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the command sets its device count
    config = dict(model_type="llama", vocab_size=VOCAB, hidden_size=EMBED, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=MLP,
                  hidden_act="silu", tie_word_embeddings=True, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    main(["plan", "--config", str(tmp_path), "--devices", "4", "--fsdp", "2", "--tensor", "2", "--batch", "4",
          "--seq-len", "16", "--dtype", "float32", "--json-out", str(out)])
    printed = capsys.readouterr().out
    assert "on 4 cpu devices (fsdp=2 x tensor=2)" in printed and "optimizer state" in printed
    written = json.loads(out.read_text())
    assert written["parameter_count"] == MATRICES + NORMS
    assert written["mesh"]["fsdp"] == written["mesh"]["tensor"] == 2
    assert written["total"] == written["arguments"] + written["outputs"] - written["aliased"] + written["temporaries"]

    with pytest.raises(SystemExit):
        main(["plan", "--preset", "llama-3-8b", "--config", str(tmp_path)])
    assert "exactly one of --preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "llama-9"])
    assert "presets are ['llama-3-8b'" in capsys.readouterr().err


HLO = """HloModule step

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %g = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %r = f32[8,4]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i, %r)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[4,16]) -> f32[8,4] {
  %a = bf16[4,16]{1,0} parameter(0)
  %gathered = bf16[8,16]{1,0} all-gather(%a), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %started = (bf16[4,16]{1,0}, bf16[8,16]{1,0}) all-gather-start(%a), channel_id=3, dimensions={0}
  %done = bf16[8,16]{1,0} all-gather-done(%started)
  %loop = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %open = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_collectives_count_each_loop_iteration():
    found = count_collectives(HLO)
    # 3 runs of the counted loop and 1 of the loop whose length XLA did not record.
    assert (found["all-reduce"].count, found["all-reduce"].bytes) == (4, 4 * 8 * 4 * 4)
    assert (found["all-gather"].count, found["all-gather"].bytes) == (2, 2 * 8 * 16 * 2)  # start counted, done not
    assert found["all-to-all"].count == found["reduce-scatter"].count == 0
    assert found.unknown_trip_counts == 1
    with pytest.raises(ValueError, match="ENTRY"):
        count_collectives("%body (p: f32[]) -> f32[] {\n}\n")


def test_plan_command_splits_a_mixtures_experts_over_the_expert_axis(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the command sets its device count
    experts, expert_features = 8, 32
    config = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=EMBED, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=MLP,
                  hidden_act="silu", tie_word_embeddings=True, max_position_embeddings=64, num_experts=experts,
                  num_experts_per_tok=2, moe_intermediate_size=expert_features, norm_topk_prob=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    split = plan_command.run(config=str(tmp_path), devices=4, batch=4, seq_len=16, dtype="float32", min_shard=1,
                             expert=2)
    assert "(data=2 x expert=2)" in capsys.readouterr().out
    expert_bytes = LAYERS * experts * 3 * EMBED * expert_features * 4  # float32 gate, up and down kernels
    # every other weight is replicated (no fsdp or tensor axis); each device holds half of each expert
    assert split.parameters == 4 * split.parameter_count - expert_bytes // 2
    # each layer trades rows out and back in the forward pass, and again in the backward pass
    assert split.collectives["all-to-all"].count >= 3 * LAYERS


def test_plan_command_sets_the_mixtures_dispatch_and_capacity(monkeypatch):
    planned = {}

    class Planned:
        def report(self):
            return "planned"

    def record(model, mesh, **settings):
        planned.update(model=model, mesh=mesh)
        return Planned()

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setattr(planning, "plan", record)
    plan_command.run(preset="qwen3-30b-a3b", devices=16, fsdp=2, expert=8, capacity_factor=1.25)
    assert planned["mesh"].expert == 8 and planned["mesh"].fsdp == 2
    assert planned["model"].mixture["dispatch"] == "exchange" and planned["model"].mixture["capacity_factor"] == 1.25
    plan_command.run(preset="qwen3-30b-a3b", devices=16, fsdp=16, dispatch="global")
    assert planned["model"].mixture["dispatch"] == "global" and planned["model"].mixture["capacity_factor"] is None
    # the preset is Qwen3-30B-A3B's shape: 30.53B parameters, every layer a mixture
    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    params = jax.eval_shape(planned["model"].init, jax.random.key(0), ids)["params"]
    assert sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)) == 30_532_122_624
    assert planned["model"].mlp_plan == ("mixture",) * 48
