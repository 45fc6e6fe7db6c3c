"""dew.pipeline for every kind of source: saved runs of each objective, published checkpoint
directories and Hub repositories (from a locally populated cache, offline), and the task controls."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew import Checkpoints, Dataset, Field, InputSpec, Trainer
from dew.config import ModelConfig, ObjectiveConfig, OptimConfig, RunConfig
from dew.data import ByteTokenizer
from dew.diffusion.discrete import MDLM
from dew.diffusion.presets import Flow
from dew.inference import MaskedGeneration, RunProcessor, TextGeneration, TextToImage
from dew.interop import PretrainedDecoder
from dew.nn.backbones import CausalTransformer, SimpleDiT
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.lm import LMObjective, Samples
from dew.objectives.masked import MaskedDiffusionObjective
from dew.objectives.rl import DPOObjective, GRPOObjective
from dew.sampling import CFG, Sampling
from dew.training import Layout, MeshSpec

LLAMA = "tests/fixtures/hf/llama"
KEY = jax.random.key(7)


def decoder(vocab=16, causal=True):
    return CausalTransformer(vocab_size=vocab, emb_features=32, num_layers=1, num_heads=2, mlp_features=64,
                             max_seq_len=32, causal=causal)


def save_run(directory, objective, batch, *, steps=3, tokenizer=None, sampling=None):
    """Train `objective` a few steps on `batch` (all rows in every batch), checkpoint it and record the run."""
    data = Dataset.from_records(batch, batch=len(next(iter(batch.values()))))
    optim = OptimConfig(optimizer="adam", learning_rate=1e-2)
    checkpoints = Checkpoints(directory)
    trainer = Trainer(objective, optim.build(), key=jax.random.key(0), checkpoints=checkpoints)
    state = trainer.fit(data, steps=steps, log_every=steps, checkpoint_every=steps)
    checkpoints.wait()
    RunConfig(model=ModelConfig.from_model(objective.model), optim=optim,
              objective=ObjectiveConfig.from_objective(objective), sampling=sampling).save(directory, tokenizer=tokenizer)
    return state


def same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- every run kind with a task ---------------------------------------------------------------------


def test_an_lm_run_reloads_bitwise_with_its_tokenizer_sampling_and_budget(tmp_path):
    tokenizer = ByteTokenizer()
    model = CausalTransformer(vocab_size=256, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, max_seq_len=32)
    samples = Samples(prompt="ab", max_new_tokens=5, n=2, sampling=Sampling(temperature=0.8), tokenizer=tokenizer)
    objective = LMObjective(model, seq_len=8, ema_decay=0.5, samples=samples, tokenizer=tokenizer)
    batch = {"text": np.tile(np.frombuffer(b"abcabcabc", np.uint8).astype(np.int32), (4, 1))}
    state = save_run(tmp_path / "run", objective, batch, tokenizer=tokenizer)

    task = dew.pipeline(tmp_path / "run")
    direct = objective.pipeline(state)
    assert isinstance(task, TextGeneration) and task.max_new_tokens == 5 and task.n == 2
    assert task.sampling == Sampling(temperature=0.8)
    drawn, expected = task("ab", seed=3), direct("ab", seed=3)
    same(drawn.host().tokens, expected.tokens)
    assert len(drawn.tokens.sharding.device_set) == jax.device_count()  # data parallel by default
    assert drawn.rows == 2 and len(drawn.text) == 2 and drawn.text == expected.text
    # the EMA copy by default; the live weights differ
    live = dew.pipeline(tmp_path / "run", ema=False)
    same(live.variables["params"], state.variables["params"])
    assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(live.variables)[0]),
                              np.asarray(jax.tree_util.tree_leaves(task.variables)[0]))


def test_a_run_without_ema_refuses_ema_true_and_serves_the_live_weights_on_request(tmp_path):
    model = decoder()
    objective = LMObjective(model, seq_len=8)
    state = save_run(tmp_path / "run", objective, {"text": np.tile(np.arange(9, dtype=np.int32) % 4, (4, 1))})
    with pytest.raises(ValueError, match="keeps no EMA copy.*ema=False"):
        dew.pipeline(tmp_path / "run")
    with pytest.raises(ValueError, match="keeps no EMA copy"):
        objective.pipeline(state)
    task = dew.pipeline(tmp_path / "run", ema=False)
    same(task([[1, 2]], 4, seed=0).host().tokens, objective.pipeline(state, ema=False)([[1, 2]], 4, seed=0).host().tokens)
    with pytest.raises(ValueError, match="no checkpoint at step 7; its steps are \\[3\\]"):
        dew.pipeline(tmp_path / "run", step=7, ema=False)
    with pytest.raises(ValueError, match="Text prompts need a processor"):
        task("ab", 3, seed=0)
    # compute and storage dtypes
    half = dew.pipeline(tmp_path / "run", ema=False, dtype="bfloat16", param_dtype="bfloat16")
    assert half.model.dtype == jnp.bfloat16 and model.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(half.variables)} == {jnp.dtype(jnp.bfloat16)}
    assert half([[1, 2]], 4, seed=0).host().tokens.shape == (1, 4)
    bound = objective.pipeline(state, ema=False, processor=RunProcessor(_Letters()))
    assert bound("abc", 3, seed=0).text == [_Letters().decode(np.asarray(bound("abc", 3, seed=0).tokens[0]))]


class _Letters:
    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i)) for i in ids)


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_dpo_and_grpo_runs_publish_the_policy_never_the_reference(tmp_path, kind):
    model = decoder()
    start = {"params": jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]}
    if kind == "dpo":
        objective = DPOObjective(model, seq_len=8, beta=0.1, variables=start, ema_decay=0.5)
        row = np.arange(9, dtype=np.int32) % 5
        mask = np.r_[np.zeros(4), np.ones(5)].astype(np.float32)
        batch = {"chosen": np.tile(row, (2, 1)), "rejected": np.tile((row + 1) % 5, (2, 1)),
                 "chosen_mask": np.tile(mask, (2, 1)), "rejected_mask": np.tile(mask, (2, 1))}
    else:
        objective = GRPOObjective(model, seq_len=8, beta=0.1, variables=start, ema_decay=0.5)
        row = np.arange(9, dtype=np.int32) % 5
        batch = {"text": np.tile(row, (4, 1)), "response_mask": np.tile(np.r_[np.zeros(4), np.ones(5)], (4, 1)).astype(np.float32),
                 "advantages": np.array([1.0, -1.0, 0.5, -0.5], np.float32),
                 "old_log_probs": np.zeros((4, 9), np.float32)}
    state = save_run(tmp_path / "run", objective, batch)
    task = dew.pipeline(tmp_path / "run")
    assert set(task.variables) == {"params"}
    same(task.variables["params"], state.ema)
    same(task([[1, 2, 3]], 4, seed=2).host().tokens, objective.pipeline(state)([[1, 2, 3]], 4, seed=2).host().tokens)


def test_a_diffusion_run_reloads_bitwise_and_takes_guidance_as_a_scale(tmp_path):
    model = SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2, num_classes=3)
    objective = DiffusionObjective(model, Flow(), InputSpec(Field("image", (8, 8, 1)), conditions={"label": Field("label", ())}),
                                   ema_decay=0.5)
    rng = np.random.default_rng(0)
    batch = {"image": rng.integers(0, 256, (4, 8, 8, 1), dtype=np.uint8), "label": np.arange(4, dtype=np.int32) % 3}
    state = save_run(tmp_path / "run", objective, batch)
    task = dew.pipeline(tmp_path / "run")
    assert isinstance(task, TextToImage)
    drawn = task([0, 1, None], steps=3, seed=1).host().images
    same(drawn, objective.pipeline(state)([0, 1, None], steps=3, seed=1).host().images)
    scaled = task([0, 1], steps=3, guidance=3.0, seed=1).host().images
    same(scaled, task([0, 1], steps=3, guidance=CFG(3.0), seed=1).host().images)
    assert not np.array_equal(scaled, task([0, 1], steps=3, guidance=None, seed=1).host().images)
    with pytest.raises(TypeError, match="guidance must be a CFG, a plain scale"):
        task([0], steps=3, guidance="strong", seed=1)


def test_a_masked_diffusion_run_reloads_bitwise(tmp_path):
    model = decoder(vocab=17, causal=False)
    objective = MaskedDiffusionObjective(model, MDLM(mask_id=16)(), seq_len=8, ema_decay=0.5)
    state = save_run(tmp_path / "run", objective, {"text": np.tile(np.arange(8, dtype=np.int32) % 6, (4, 1))})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["objective"]["settings"]["process"]["fields"]["mask_id"] == 16
    task = dew.pipeline(tmp_path / "run")
    assert isinstance(task, MaskedGeneration)
    same(task([[1, 2]], 5, seed=4, steps=3).host().tokens, objective.pipeline(state)([[1, 2]], 5, seed=4, steps=3).host().tokens)


def test_a_jepa_run_says_it_has_no_generation_task(tmp_path):
    (tmp_path / "run").mkdir()
    record = {"format": "dew.run", "version": 1, "model": {"target": "dew.nn.backbones.jepa.JepaEncoder", "settings": {}},
              "objective": {"target": "dew.objectives.jepa.JepaObjective", "settings": {}}}
    (tmp_path / "run" / "run.json").write_text(json.dumps(record))
    with pytest.raises(TypeError, match="JepaObjective run, which has no generation task.*KnnProbe"):
        dew.pipeline(tmp_path / "run")


def test_sources_that_are_nothing_dew_reads_say_what_was_tried(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a saved run \\(no run.json\\) nor a Hugging Face checkpoint"):
        dew.pipeline(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory .* and not a Hub repository id"):
        dew.pipeline(tmp_path / "missing" / "deeper")
    with pytest.raises(FileNotFoundError, match="could not be read from the cache"):
        dew.pipeline("acme/not-cached")
    with pytest.raises(ValueError, match="step=3 picks one of a saved run's checkpoints"):
        dew.pipeline(LLAMA, step=3)


# --- placement on a mesh ----------------------------------------------------------------------------


def test_a_run_placed_on_a_mesh_shards_rows_with_filler_and_host_returns_the_real_ones(tmp_path):
    model = decoder()
    objective = LMObjective(model, seq_len=8, ema_decay=0.5)
    state = save_run(tmp_path / "run", objective, {"text": np.tile(np.arange(9, dtype=np.int32) % 4, (8, 1))})
    task = dew.pipeline(tmp_path / "run", mesh=MeshSpec(fsdp=2), layout=Layout(min_shard=1))
    leaves = jax.tree_util.tree_leaves(task.variables)
    assert all(len(leaf.sharding.device_set) == 8 for leaf in leaves)
    assert any("fsdp" in str(leaf.sharding.spec) for leaf in leaves)  # placed by the Trainer's rules
    result = task([[1, 2], [3]], 4, seed=0, n=2)
    assert result.tokens.shape[0] == 8 * 2 and result.rows == 4  # 2 real prompts padded to 8, twice
    assert len(result.tokens.sharding.device_set) == 8
    single = objective.pipeline(state)([[1, 2], [3]], 4, seed=0, n=2)
    same(result.host().tokens, single.host().tokens)


# --- published checkpoints and the Hub cache --------------------------------------------------------


def logits_of(task, ids):
    return np.asarray(task.model.apply(task.variables, jnp.asarray(ids)))


def test_a_hub_id_loads_the_same_logits_as_its_directory_and_revision_picks_the_snapshot(hub_cache, tmp_path):
    files = {name: f"{LLAMA}/{name}" for name in ("config.json", "generation_config.json", "model.safetensors")}
    hub_cache("acme/tiny-llama", files)
    ids = np.load(f"{LLAMA}/reference.npz")["input_ids"]
    local = dew.pipeline(LLAMA)
    from_hub = dew.pipeline("acme/tiny-llama")
    np.testing.assert_array_equal(logits_of(from_hub, ids), logits_of(local, ids))
    np.testing.assert_allclose(logits_of(from_hub, ids), np.load(f"{LLAMA}/reference.npz")["logits"], atol=2e-4)

    # a second revision with other weights: revision= picks it, the default stays on main
    other = PretrainedDecoder.load(LLAMA)
    changed = jax.tree_util.tree_map(lambda a: a * 1.5, other.variables)
    other.save(tmp_path / "v2", changed)
    hub_cache("acme/tiny-llama", {n: tmp_path / "v2" / n for n in ("config.json", "model.safetensors")}, revision="v2")
    pinned = dew.pipeline("acme/tiny-llama", revision="v2")
    assert not np.allclose(logits_of(pinned, ids), logits_of(from_hub, ids), atol=1e-3)
    np.testing.assert_array_equal(logits_of(PretrainedDecoder.load("acme/tiny-llama", revision="v2").text_generation(), ids),
                                  logits_of(pinned, ids))
    np.testing.assert_array_equal(logits_of(dew.pipeline("acme/tiny-llama"), ids), logits_of(local, ids))
    with pytest.raises(FileNotFoundError, match="at revision 'v3' could not be read"):
        dew.pipeline("acme/tiny-llama", revision="v3")


def test_tokenizers_and_dew_tokenize_read_a_hub_id_from_the_cache(hub_cache, tmp_path):
    from dew.cli.main import main
    from dew.data import HFTokenizer, load_tokenizer

    source = "tests/fixtures/tokenizers/tiny-tools"
    names = [p.name for p in __import__("pathlib").Path(source).iterdir() if p.is_file()]
    hub_cache("acme/tools", {name: f"{source}/{name}" for name in names})
    local = HFTokenizer(source)
    cached = load_tokenizer("acme/tools")
    assert cached.encode("hello tools") == local.encode("hello tools") and cached.chat_template == local.chat_template
    from dew.data import ChatMessages

    conversation = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello tools"}]}
    by_id = ChatMessages([conversation], "acme/tools", seq_len=32)
    by_object = ChatMessages([conversation], local, seq_len=32)
    np.testing.assert_array_equal(by_id.render(conversation)[0], by_object.render(conversation)[0])
    (tmp_path / "in.txt").write_text("hello tools " * 50)
    main(["tokenize", "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "corpus"), "--tokenizer", "acme/tools"])
    meta = json.loads((tmp_path / "corpus" / "meta.json").read_text())
    assert meta["vocab_size"] == local.vocab_size


# --- controls ---------------------------------------------------------------------------------------


def with_generation_config(tmp_path, **settings):
    directory = tmp_path / "checkpoint"
    shutil.copytree(LLAMA, directory)
    config = json.loads((directory / "generation_config.json").read_text())
    config.update(settings)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_budget_and_continuations_default_from_generation_config_and_the_call_wins(tmp_path):
    task = dew.pipeline(with_generation_config(tmp_path, max_new_tokens=5, num_return_sequences=3))
    assert task.max_new_tokens == 5 and task.n == 3
    drawn = task([[1, 2, 3]], seed=0)
    assert drawn.host().tokens.shape == (3, 5) and drawn.rows == 3
    one = task([[1, 2, 3]], 2, seed=0, n=1)
    assert one.host().tokens.shape == (1, 2)
    same(one.host().tokens, drawn.host().tokens[:1, :2])  # continuation zero is the n=1 draw

    shutil.rmtree(tmp_path / "checkpoint")
    by_length = dew.pipeline(with_generation_config(tmp_path, max_length=12))
    assert by_length([[1, 2, 3]], seed=0).host().tokens.shape == (1, 12 - 8)  # 3 prompt tokens pad to width 8
    with pytest.raises(ValueError, match="No continuation budget"):
        dew.pipeline(LLAMA)([[1, 2, 3]], seed=0)
    with pytest.raises(ValueError, match="more than the model's max_seq_len"):
        dew.pipeline(LLAMA)([[1, 2, 3]], 10_000, seed=0)


@pytest.mark.parametrize("control", [{"repetition_penalty": 1.3}, {"max_time": 2.0}, {"num_beams": 4}])
def test_unsupported_generation_controls_raise_when_building_from_source_defaults(tmp_path, control):
    with pytest.raises(ValueError, match=f"sets {{'{next(iter(control))}'.*does not implement"):
        dew.pipeline(with_generation_config(tmp_path, **control))
    neutral = with_generation_config(tmp_path / "neutral", repetition_penalty=1.0, num_beams=1)
    assert isinstance(dew.pipeline(neutral), TextGeneration)


def test_seed_and_key_are_exclusive_and_text_is_decoded_once():
    model = decoder()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    calls = []

    class Counting(_Letters):
        def decode(self, ids):
            calls.append(1)
            return super().decode(ids)

    task = TextGeneration(model, variables, sampling=Sampling(temperature=1.0), processor=Counting())
    same(task("ab", 3, seed=5).host().tokens, task("ab", 3, key=jax.random.key(5)).host().tokens)
    for kwargs in ({}, {"seed": 1, "key": KEY}):
        with pytest.raises(ValueError, match="exactly one of seed= .* or key="):
            task("ab", 3, **kwargs)
    with pytest.raises(ValueError, match="seed must be an int"):
        task("ab", 3, seed=1.5)
    result = task(["ab", "c"], 3, seed=0, n=2)
    assert result.rows == 4 and len(result.text) == 4 and len(calls) == 4
    assert result.text is result.text and len(calls) == 4  # cached after the first read
    with pytest.raises(ValueError, match="no processor to decode it"):
        TextGeneration(model, variables)([[1]], 2, seed=0).text
    with pytest.raises(ValueError, match="n must be a positive integer; got 0"):
        task("ab", 3, seed=0, n=0)
    other = jax.tree_util.tree_map(lambda a: a + 1.0, variables)
    assert task.bind(other).variables is other and task.variables is variables
    assert task.bind(other).weights is not task.weights  # a bound task converts its own weights


def test_one_row_decodes_through_the_decode_layout_and_draws_what_generate_draws():
    from dew.inference.decode_layout import DecodeTransformer
    from dew.sampling.text import generate

    model = decoder()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    task = TextGeneration(model, variables, sampling=Sampling(temperature=0.0))
    assert isinstance(task.weights.get(1)[0], DecodeTransformer) and task.weights.get(2)[0] is model
    same(task([[1, 2, 3]], 6, seed=0).host().tokens, generate(model, variables, [[1, 2, 3]], 6, key=KEY,
                                                       sampling=Sampling(temperature=0.0)).tokens)


def test_processor_chat_renders_the_checkpoints_template_with_its_controls():
    """task.processor.chat(messages, **controls) gives the rows transformers' apply_chat_template
    renders (recorded by tools/harness_fixtures.py through lm-eval's HFLM), which the task takes as they are."""
    from dew.data import HFTokenizer

    fixture = "tests/fixtures/harness"
    recorded = json.loads(open(f"{fixture}/expected.json").read())["chat"]["prompts"][0]
    task = dew.pipeline(f"{fixture}/model")
    processor = RunProcessor(HFTokenizer(f"{fixture}/tokenizer-think"))
    (quiet,) = processor.chat(recorded["history"], enable_thinking=False)
    (default,) = processor.chat(recorded["history"])
    assert quiet.tolist() == processor.tokenizer.encode(recorded["enable_thinking_false"])
    assert default.tolist() == processor.tokenizer.encode(recorded["default"]) and len(default) < len(quiet)
    both = processor.chat([recorded["history"], recorded["history"][1:]], enable_thinking=False)
    drawn = task(both, 3, key=0).host()
    assert drawn.tokens.shape == (2, 3)
    assert np.array_equal(drawn.tokens, task(both, 3, seed=0).host().tokens)  # an int key seeds as seed= does
    with pytest.raises(ValueError, match="reads no reasoning_effort; the controls it reads are: enable_thinking"):
        processor.chat(recorded["history"], reasoning_effort="low")
    with pytest.raises(ValueError, match="carries no chat template"):
        RunProcessor(ByteTokenizer()).chat(recorded["history"])
