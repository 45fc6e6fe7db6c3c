"""JEPA: masks, the EMA target encoder, resume, probes, the README program, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Dataset, Field, Trainer
from dew.eval.probes import (
    KnnProbe,
    LinearProbe,
    effective_rank,
    feature_std,
    knn_accuracy,
    labels_per_class,
)
from dew.objectives.base import Step
from dew.objectives.jepa import JepaEncoder, JepaObjective, JepaPredictor, MultiBlockMask
from dew.training.mesh import unbox

SHAPE = (16, 16, 3)  # 4x4 patches of 4x4 pixels


def tiny_objective(momentum=(0.5, 0.9), momentum_steps=4, **mask):
    mask = MultiBlockMask.for_grid((4, 4), **{"num_targets": 2, "scale": (0.15, 0.2), **mask})
    return JepaObjective(
        JepaEncoder(patch_size=4, emb_features=16, num_layers=1, num_heads=2),
        JepaPredictor(grid=(4, 4), emb_features=16, predictor_features=8, num_layers=1, num_heads=2),
        mask=mask,
        sample=Field("image", SHAPE),
        momentum=momentum,
        momentum_steps=momentum_steps,
    )


def random_images(count, seed=0, shape=SHAPE):
    return np.random.default_rng(seed).integers(0, 256, (count,) + shape, dtype=np.uint8)


def tiny_data(count=32, batch=8):
    return Dataset.from_records({"image": random_images(count)}, batch=batch, seed=3)


def host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def digits_64(count=None):
    """scikit-learn's digits as uint8 [N, 64, 64, 3] (nearest upsampling), with labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images * (255.0 / 16.0)).round().astype(np.uint8)
    images = np.repeat(np.repeat(images, 8, axis=1), 8, axis=2)[..., None].repeat(3, axis=-1)
    return images[:count], data.target[:count]


# ---- masks ----------------------------------------------------------------------------------


def test_masks_have_fixed_counts_never_overlap_and_differ_per_example_and_key():
    mask = MultiBlockMask.for_grid((8, 8), num_targets=3, scale=(0.15, 0.2))
    assert (mask.target_tokens, mask.context_tokens) == (9, 31)
    sample = jax.jit(mask.sample, static_argnums=1)
    first, second = host(sample(jax.random.key(0), 16)), host(sample(jax.random.key(1), 16))
    assert first.context.shape == (16, 31) and first.targets.shape == (16, 3, 9)
    for context, targets in zip(first.context, first.targets):
        assert len(set(context)) == 31 and all(len(set(t)) == 9 for t in targets)
        assert set(context).isdisjoint(targets.ravel())
        assert 0 <= context.min() and context.max() < 64 and targets.max() < 64
        assert np.all(np.diff(context) > 0)
    assert len({tuple(c) for c in first.context}) > 1  # per example
    assert len({t.tobytes() for t in first.targets}) > 1
    assert not np.array_equal(first.targets, second.targets)  # per key


def test_target_blocks_are_rectangles_trimmed_in_raster_order():
    mask = MultiBlockMask.for_grid((8, 8), num_targets=1, scale=(0.25, 0.25))
    targets = host(mask.sample(jax.random.key(5), 32).targets)[:, 0]
    for block in targets:
        rows, cols = block // 8, block % 8
        width = cols.max() - cols.min() + 1
        # full rows of one width, then at most one partial row
        assert len(block) == 16 and (rows.max() - rows.min() + 1) == -(-16 // width)


def test_tube_masks_repeat_the_spatial_mask_through_time():
    mask = MultiBlockMask.for_grid((3, 4, 4), num_targets=2, scale=(0.15, 0.2))
    assert mask.tube and mask.target_tokens == 3 * 2 and mask.context_tokens == 3 * mask._context_block_tokens
    masks = host(mask.sample(jax.random.key(2), 4))
    for index in (masks.context[0], masks.targets[0, 1]):
        per_frame = index.reshape(3, -1)
        assert np.array_equal(per_frame - np.arange(3)[:, None] * 16, np.broadcast_to(per_frame[0], per_frame.shape))
    assert set(masks.context[0]).isdisjoint(masks.targets[0].ravel())


# ---- the target encoder ---------------------------------------------------------------------


def test_the_target_encoder_receives_no_gradient():
    objective = tiny_objective()
    batch = {"image": jnp.asarray(random_images(8))}

    @jax.jit
    def gradients(key):
        variables = unbox(objective.init(key))
        step = Step(step=jnp.int32(0), key=key)
        return jax.grad(lambda v: objective.loss(v, batch, step)[0])(variables)

    grads = gradients(jax.random.key(0))
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree_util.tree_leaves(grads["target"]))
    assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree_util.tree_leaves(grads["params"]["encoder"]))
    assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree_util.tree_leaves(grads["params"]["predictor"]))


def test_the_target_follows_the_momentum_schedule_after_each_update():
    objective = tiny_objective(momentum=(0.5, 0.9), momentum_steps=4)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    step_fn = trainer.compiled_step()
    state = trainer.init_state()
    before = host(state.variables)
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(np.array_equal, before["target"], before["params"]["encoder"])
    )
    images = random_images(16)
    for step, rows in enumerate((slice(0, 8), slice(8, 16))):
        state, _ = step_fn(state, trainer.place({"image": images[rows]}))
        after = host(state.variables)
        m = np.float32(0.5 + step * (0.9 - 0.5) / 4)  # linear from momentum[0] over momentum_steps
        expected = jax.tree_util.tree_map(
            lambda t, p: m * t + (np.float32(1) - m) * p, before["target"], after["params"]["encoder"]
        )
        close = jax.tree_util.tree_map(lambda a, b: np.allclose(a, b, rtol=1e-6, atol=1e-7), after["target"], expected)
        assert jax.tree_util.tree_all(close), f"target after update {step + 1} is not the EMA"
        # the encoder moved, and the target did not simply copy it
        assert not np.array_equal(after["target"]["norm"]["bias"], after["params"]["encoder"]["norm"]["bias"])
        before = after
    assert float(objective.momentum_at(10)) == pytest.approx(0.9)  # held at the end after the ramp


def test_resume_restores_the_target_encoder_bit_for_bit(tmp_path):
    def trainer():
        return Trainer(tiny_objective(), optax.adam(1e-2), key=jax.random.key(4), checkpoints=Checkpoints(tmp_path))

    first = trainer()
    state = first.fit(tiny_data(), steps=2, log_every=2, checkpoint_every=2)
    first.checkpoints.wait()
    saved = host(state.variables)
    assert not jax.tree_util.tree_all(  # the target has moved off its initial copy of the encoder
        jax.tree_util.tree_map(np.array_equal, saved["target"], saved["params"]["encoder"])
    )
    restored, position, step = trainer().restore_or_init()  # a fresh process would do this
    assert step == 2 and position is not None
    restored = host(restored.variables)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(saved)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, restored, saved))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a: a.dtype == np.float32, restored["target"]))


# ---- diagnostics and probes -----------------------------------------------------------------


def test_effective_rank_and_feature_std_match_numpy():
    x = np.random.default_rng(0).normal(size=(32, 12)) * np.linspace(0.1, 3.0, 12)
    for center in (True, False):
        y = x - x.mean(0) if center else x
        s = np.linalg.svd(y, compute_uv=False)
        p = s / s.sum()
        assert float(effective_rank(x, center=center)) == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-4)
    assert float(feature_std(x)) == pytest.approx(x.std(axis=0).mean(), rel=1e-5)
    collapsed = np.tile(x[:1], (32, 1))
    assert float(effective_rank(collapsed)) < 1.05 < 8.0 < float(effective_rank(x))
    assert float(feature_std(collapsed)) == pytest.approx(0.0, abs=1e-6)
    assert float(effective_rank(np.eye(8))) == pytest.approx(7.0, rel=1e-3)  # centering removes one direction


def test_probes_score_separable_features_and_ignore_noise():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 30)
    rng.shuffle(labels)
    centers = rng.normal(size=(4, 16)) * 5
    features = centers[labels] + rng.normal(size=(120, 16))
    noise = rng.normal(size=(120, 16))

    def run(metric, x):
        accumulator = metric.empty()
        for rows in np.split(np.arange(120), 4):
            accumulator = metric.update(accumulator, {"features": x[rows], "label": labels[rows], "_rows": 30})
        return metric.result(accumulator)[metric.name]

    for metric in (KnnProbe(4), KnnProbe(4, split="leave_one_out"), LinearProbe(4), LinearProbe(4, labels_per_class=3)):
        assert run(metric, features) > 0.95
        assert run(metric, noise) < 0.5
    assert len(labels_per_class(labels, 3)) == 12
    assert knn_accuracy(features[:60], labels[:60], features[60:], labels[60:], 4, k=5) > 0.95


# ---- the README program ---------------------------------------------------------------------


def test_the_readme_jepa_program_runs_with_digits():
    images, labels = digits_64(16 * 8 + 32)
    data = Dataset.from_records(
        {"image": images[32:], "label": labels[32:]},
        batch=16,
        validation={"image": images[:32], "label": labels[:32]},  # two validation batches
    )
    encoder = JepaEncoder(
        patch_size=8,
        emb_features=64,
        num_layers=2,
        num_heads=4,
    )
    predictor = JepaPredictor(
        grid=(8, 8),
        emb_features=64,
        predictor_features=32,
        num_layers=1,
        num_heads=4,
    )
    objective = JepaObjective(
        encoder,
        predictor,
        mask=MultiBlockMask.for_grid((8, 8), num_targets=1, scale=(0.25, 0.25)),
        sample=Field("image", (64, 64, 3)),
        momentum_steps=20,
    )
    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0))
    state = trainer.fit(data, steps=20, log_every=10, eval_every=20, metrics=(KnnProbe(10),))
    assert int(state.step) == 20
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]
    scores = trainer.evaluations[-1].scores
    assert 0.0 <= scores["val/knn_accuracy"] <= 1.0
    assert scores["val/effective_rank"] > 1.0 and scores["val/target_std"] > 0.0
    assert set(state.variables) == {"params", "target"}


def test_video_clips_train_with_tubelets_and_tube_masks():
    objective = JepaObjective(
        JepaEncoder(patch_size=4, emb_features=16, num_layers=1, num_heads=2, tubelet_size=2),
        JepaPredictor(grid=(2, 4, 4), emb_features=16, predictor_features=8, num_layers=1, num_heads=2),
        mask=MultiBlockMask.for_grid((2, 4, 4), num_targets=2, scale=(0.15, 0.2)),
        sample=Field("video", (4, 16, 16, 3)),
        momentum_steps=4,
    )
    clips = jnp.asarray(random_images(4, shape=(4, 16, 16, 3)))

    @jax.jit
    def loss_and_grads(key):
        variables = unbox(objective.init(key))
        step = Step(step=jnp.int32(0), key=key)
        (loss, aux), grads = jax.value_and_grad(objective.loss, has_aux=True)(variables, {"video": clips}, step)
        return loss, aux.metrics, grads

    loss, metrics, grads = loss_and_grads(jax.random.key(0))
    assert np.isfinite(float(loss)) and float(metrics["effective_rank"]) > 1.0
    assert float(jnp.abs(grads["params"]["encoder"]["patch_embed"]["kernel"]).max()) > 0.0


# ---- bad input ------------------------------------------------------------------------------


def test_a_mask_grid_that_does_not_match_the_patch_grid_is_refused():
    encoder = JepaEncoder(patch_size=8, emb_features=16, num_layers=1, num_heads=2)
    predictor = JepaPredictor(grid=(8, 8), emb_features=16, predictor_features=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match=r"mask's token grid \(4, 4\).*give \(8, 8\)"):
        JepaObjective(encoder, predictor, mask=MultiBlockMask.for_grid((4, 4)), sample=Field("image", (64, 64, 3)))
    with pytest.raises(ValueError, match="JepaPredictor grid"):
        JepaObjective(
            encoder,
            JepaPredictor(grid=(4, 4), emb_features=16, predictor_features=8, num_layers=1, num_heads=2),
            mask=MultiBlockMask.for_grid((8, 8)),
            sample=Field("image", (64, 64, 3)),
        )
    with pytest.raises(ValueError, match="not a multiple of patch_size=8"):
        JepaObjective(encoder, predictor, mask=MultiBlockMask.for_grid((8, 8)), sample=Field("image", (60, 64, 3)))
    with pytest.raises(ValueError, match="emb_features"):
        JepaObjective(
            encoder,
            JepaPredictor(grid=(8, 8), emb_features=32, predictor_features=8, num_layers=1, num_heads=2),
            mask=MultiBlockMask.for_grid((8, 8)),
            sample=Field("image", (64, 64, 3)),
        )


def test_target_scales_that_leave_no_context_are_refused():
    with pytest.raises(ValueError, match="leaves no context"):
        MultiBlockMask.for_grid((4, 4), num_targets=2, scale=(0.5, 0.6))
    with pytest.raises(ValueError, match="scale must satisfy"):
        MultiBlockMask.for_grid((4, 4), scale=(0.3, 0.2))
    with pytest.raises(ValueError, match="grid must be"):
        MultiBlockMask.for_grid((4,))


def test_images_of_the_wrong_shape_or_dtype_fail_before_compiling():
    trainer = Trainer(tiny_objective(), optax.adam(1e-3), key=jax.random.key(0))
    wrong_shape = Dataset.from_records({"image": random_images(8, shape=(8, 8, 3))}, batch=8)
    with pytest.raises(ValueError, match=r"'image' has shape \(8, 8, 8, 3\).*expects \('batch', 16, 16, 3\)"):
        trainer.fit(wrong_shape, steps=1)
    floats = Dataset.from_records({"image": random_images(8).astype(np.float32)}, batch=8)
    with pytest.raises(ValueError, match="expects uint8"):
        trainer.fit(floats, steps=1)
    missing = Dataset.from_records({"pixels": random_images(8)}, batch=8)
    with pytest.raises(ValueError, match="no field 'image'"):
        trainer.fit(missing, steps=1)
    assert trainer._step_fn is None or trainer._step_fn._cache_size() == 0  # nothing was compiled


def test_probes_without_labels_say_what_they_need():
    with pytest.raises(ValueError, match="'label'"):
        KnnProbe(10).update(KnnProbe(10).empty(), {"features": np.zeros((4, 8)), "loss": np.float32(0)})
    probe = LinearProbe(3)
    accumulator = probe.update(probe.empty(), {"features": np.zeros((4, 2)), "label": np.array([0, 1, 5, 2])})
    with pytest.raises(ValueError, match="3 classes"):
        probe.result(accumulator)


# ---- real training --------------------------------------------------------------------------


@pytest.mark.slow
def test_jepa_on_digits_beats_the_random_encoder_and_reaches_80_percent():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "jepa_digits.py"
    spec = importlib.util.spec_from_file_location("jepa_digits", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    jepa, random_init, pixels = example.main([])
    assert jepa["linear"] >= 0.80
    assert jepa["linear"] > random_init["linear"] and jepa["knn"] > random_init["knn"]
    assert jepa["effective_rank"] > 4.0
