"""LMObjective: the shifted next-token loss, its masks, perplexity over a pass, and the spec programs."""

import itertools
import json
import math

import grain.python as grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Dataset, Evaluation, LocalTracker, Trainer
from dew.data.chat import Role
from dew.nn.backbones import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective, Perplexity, Samples
from dew.sampling import Sampling


def tiny(vocab=16, **kw):
    return CausalTransformer(vocab_size=vocab, emb_features=32, num_layers=1, num_heads=2,
                             mlp_features=64, max_seq_len=32, **kw)


def manual_losses(model, variables, tokens):
    logits = model.apply(variables, tokens[:, :-1])
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -np.take_along_axis(np.asarray(log_probs), np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]


def test_loss_is_the_mean_cross_entropy_of_the_shifted_row():
    model = tiny()
    objective = LMObjective(model, seq_len=8)
    variables = objective.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, 16)
    loss, aux = objective.loss(variables, {"text": tokens}, Step(0, jax.random.key(2)))
    expected = manual_losses(model, variables, tokens)
    assert float(loss) == pytest.approx(float(expected.mean()), rel=1e-5)
    assert float(aux.metrics["tokens"]) == 24


def test_assistant_only_loss_counts_only_assistant_targets_after_the_shift():
    model = tiny()
    objective = LMObjective(model, seq_len=8, loss_role=Role.ASSISTANT)
    variables = objective.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 16)
    roles = np.array([[Role.USER] * 4 + [Role.ASSISTANT] * 5] * 2, np.int8)
    loss, aux = objective.loss(variables, {"text": tokens, "text_roles": roles}, Step(0, jax.random.key(2)))
    expected = manual_losses(model, variables, tokens)
    # targets are tokens 1..8; assistant tokens are 4..8, so target columns 3..7 count
    assert float(aux.metrics["tokens"]) == 10
    assert float(loss) == pytest.approx(float(expected[:, 3:].mean()), rel=1e-5)
    assert float(loss) != pytest.approx(float(expected[:, 4:].mean()), rel=1e-3)  # off-by-one is caught
    with pytest.raises(ValueError, match="text_roles"):
        objective.check({"text": np.asarray(tokens)})


def test_padding_and_segment_zero_targets_are_masked():
    model = tiny()
    objective = LMObjective(model, seq_len=8)
    variables = objective.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 9), 0, 16)
    mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0, 0]])
    loss, aux = objective.loss(variables, {"text": tokens, "mask": mask}, Step(0, jax.random.key(2)))
    assert float(aux.metrics["tokens"]) == 5
    assert float(loss) == pytest.approx(float(manual_losses(model, variables, tokens)[:, :5].mean()), rel=1e-5)


def test_perplexity_weights_batches_by_their_tokens():
    model = tiny()
    objective = LMObjective(model, seq_len=8)
    variables = objective.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    first = {"text": rng.integers(0, 16, (4, 9)).astype(np.int32), "mask": np.ones((4, 9), np.int32)}
    second = {"text": rng.integers(0, 16, (4, 9)).astype(np.int32), "mask": np.ones((4, 9), np.int32)}
    second["mask"][:, 3:] = 0  # far fewer scored tokens in the second batch
    result = Evaluation.run(objective, variables, lambda p: iter([first, second]), metrics=(Perplexity(),),
                            key=jax.random.key(0))
    losses = [manual_losses(model, variables, b["text"]) for b in (first, second)]
    weights = [b["mask"][:, 1:] for b in (first, second)]
    token_mean = sum((l * w).sum() for l, w in zip(losses, weights)) / sum(w.sum() for w in weights)
    batch_mean = np.mean([math.exp((l * w).sum() / w.sum()) for l, w in zip(losses, weights)])
    assert result.scores["val/perplexity"] == pytest.approx(math.exp(token_mean), rel=1e-5)
    assert result.scores["val/perplexity"] != pytest.approx(batch_mean, rel=1e-4)


def test_token_ids_outside_the_vocabulary_fail_before_training():
    objective = LMObjective(tiny(vocab=8), seq_len=8)
    batch = {"text": np.full((4, 9), 9, np.int32)}
    data = Dataset(train=lambda p: itertools.repeat(batch), records=4, batch=4)
    with pytest.raises(ValueError, match=r"token ids in \[9, 9\].*8 ids"):
        Trainer(objective, optax.adam(1e-3), key=jax.random.key(0)).fit(data, steps=1)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        LMObjective(tiny(), seq_len=64)


def test_composing_a_native_decoder_program_continues_the_pattern(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = CausalTransformer(
        vocab_size=8, emb_features=64, num_layers=4,
        num_heads=4, num_kv_heads=2, mlp_features=128, max_seq_len=32,
        layer_types=("sliding_attention",) * 3 + ("full_attention",),
        kinds={"sliding_attention": LayerKind(window=8)},
        dtype=jnp.float32,
    )
    row = np.resize(np.array([1, 2, 3, 4], np.int32), 17)
    batch = {"text": np.tile(row, (4, 1))}
    stream = grain.MapDataset.source([batch]).repeat().to_iter_dataset()
    data = Dataset(train=lambda partition: iter(stream), val=None, records=4, batch=4)
    objective = LMObjective(model, seq_len=16)
    checkpoints = Checkpoints("runs/custom-decoder")
    state = Trainer(objective, optax.adamw(0.003), key=jax.random.key(0),
                    checkpoints=checkpoints).fit(data, steps=40, log_every=20, checkpoint_every=40)
    checkpoints.wait()
    task = objective.pipeline(state, ema=False)
    result = task([[1, 2]], 8, key=jax.random.key(1), sampling=Sampling(temperature=0))
    assert np.asarray(result.tokens).tolist() == [[3, 4, 1, 2, 3, 4, 1, 2]]
    assert checkpoints.steps() == [40]


def test_standalone_evaluation_program_reports_perplexity_and_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = np.resize(np.array([1, 2, 3, 4], dtype=np.int32), 17)
    batch = {"text": np.tile(row, (8, 1))}
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=lambda partition: iter([batch]),
                   records=8, batch=8)
    model = CausalTransformer(vocab_size=8, emb_features=32, num_layers=1, num_heads=2, mlp_features=64,
                              max_seq_len=32)
    objective = LMObjective(model, seq_len=16, samples=Samples([1, 2], 8, sampling=Sampling(temperature=0)))
    with LocalTracker("runs/lm-report", plots=True) as tracker:
        state = Trainer(objective, optax.adam(0.01), key=jax.random.key(0), tracker=tracker).fit(
            data, steps=40, log_every=10)
        result = Evaluation.run(objective, state.variables, data.val, metrics=(Perplexity(),),
                                key=jax.random.key(1), step=int(state.step), preview=True)
        tracker.log(result.scalars, step=result.step)
        for preview in result.previews:
            tracker.artifact(preview, step=result.step)
    assert 1.0 <= result.scores["val/perplexity"] < 1.05
    text = (tmp_path / "runs/lm-report/artifacts/samples-00000040.txt").read_text()
    assert text == "1 2 3 4 1 2 3 4 1 2"
    assert (tmp_path / "runs/lm-report/plots/train_loss.png").exists()
    rows = [json.loads(l) for l in (tmp_path / "runs/lm-report/scalars.jsonl").read_text().splitlines()]
    assert any("val/perplexity" in r for r in rows)
