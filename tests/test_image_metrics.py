"""Image metrics: PSNR and SSIM against scikit-image, FID over a pass, feature networks, grids."""

import numpy as np
import pytest
from PIL import Image
from scipy import linalg
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from dew.eval.inception import torch_state_from_variables
from dew.eval.image_metrics import (
    FID,
    PSNR,
    SSIM,
    FeatureMoments,
    InceptionFeatures,
    RandomConvFeatures,
    frechet_distance,
    image_grid,
    psnr,
    save_image_grid,
    ssim,
)


def _skimage_ssim(a, b, data_range, **overrides):
    settings = dict(data_range=data_range, gaussian_weights=True, sigma=1.5,
                    use_sample_covariance=False, channel_axis=-1)
    settings.update(overrides)
    return np.asarray([structural_similarity(x, y, **settings) for x, y in zip(a, b)])


def _structured(count: int, size: int = 32) -> np.ndarray:
    """Gradients, stripes and discs in [-1, 1] (float64)."""
    y, x = np.mgrid[0:size, 0:size] / (size - 1)
    images = []
    for k in range(count):
        r = np.sin(2 * np.pi * (k + 1) * x)
        g = np.where(((x - 0.5) ** 2 + (y - 0.4) ** 2) < 0.05 * (k + 1), 0.8, -0.6)
        b = 2 * y - 1
        images.append(np.stack([r, g, b], axis=-1))
    return np.asarray(images)


# ----------------------------------------------------------------------------------------------
# PSNR and SSIM


def test_psnr_and_ssim_equal_scikit_image_on_random_uint8_images():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (4, 24, 20, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    want_psnr = [peak_signal_noise_ratio(x, y, data_range=255) for x, y in zip(a, b)]
    np.testing.assert_allclose(psnr(a, b, 255), want_psnr, rtol=0, atol=1e-8)
    np.testing.assert_allclose(ssim(a, b, 255), _skimage_ssim(a, b, 255), rtol=0, atol=1e-4)
    assert isinstance(ssim(a[0], b[0], 255), float) and isinstance(psnr(a[0], b[0], 255), float)


def test_psnr_and_ssim_equal_scikit_image_on_structured_float_images():
    rng = np.random.default_rng(1)
    a = _structured(3)
    b = np.clip(a + 0.1 * rng.standard_normal(a.shape), -1, 1)
    blurred = (a + np.roll(a, 1, axis=1) + np.roll(a, 1, axis=2)) / 3
    for other in (b, blurred):
        want = [peak_signal_noise_ratio(x, y, data_range=2.0) for x, y in zip(a, other)]
        np.testing.assert_allclose(psnr(a, other, 2.0), want, atol=1e-8)
        mine = ssim(a, other, 2.0)
        np.testing.assert_allclose(mine, _skimage_ssim(a, other, 2.0), atol=1e-4)
    # negative control: scikit-image's uniform-window SSIM is measurably different, so the
    # comparison above would catch a wrong window
    uniform = _skimage_ssim(a, b, 2.0, gaussian_weights=False)
    assert np.max(np.abs(ssim(a, b, 2.0) - uniform)) > 1e-3
    assert ssim(a, a, 2.0).tolist() == pytest.approx([1.0] * 3) and np.all(np.isinf(psnr(a, a, 2.0)))
    grey = a[0, ..., 0]
    assert ssim(grey, b[0, ..., 0], 2.0) == pytest.approx(
        structural_similarity(grey, b[0, ..., 0], data_range=2.0, gaussian_weights=True,
                              sigma=1.5, use_sample_covariance=False), abs=1e-4)


def test_psnr_and_ssim_refuse_mismatched_or_tiny_images():
    with pytest.raises(ValueError, match=r"\(2, 8, 8, 3\) and \(2, 8, 8, 1\)"):
        psnr(np.zeros((2, 8, 8, 3)), np.zeros((2, 8, 8, 1)), 1.0)
    with pytest.raises(ValueError, match="window spans 11 pixels"):
        ssim(np.zeros((8, 8, 3)), np.zeros((8, 8, 3)), 1.0)


def test_psnr_and_ssim_metrics_average_per_image_scores_over_the_pass():
    rng = np.random.default_rng(2)
    a = _structured(5, size=16)
    b = np.clip(a + 0.2 * rng.standard_normal(a.shape), -1, 1)
    for metric, score in ((PSNR(), psnr), (SSIM(), ssim)):
        accumulator = metric.empty()
        for start, stop in ((0, 2), (2, 5)):
            accumulator = metric.update(
                accumulator, {"samples": a[start:stop], "images": b[start:stop], "_rows": np.asarray(2)}
            )
        (name, value), = metric.result(accumulator).items()
        assert name == metric.name and value == pytest.approx(np.mean(score(a, b, 2.0)), abs=1e-12)
    with pytest.raises(KeyError, match="'samples'.*\\['images'\\]"):
        PSNR().update(PSNR().empty(), {"images": a})


# ----------------------------------------------------------------------------------------------
# FID


def _direct_fid(x, y):
    """FID written out with numpy.cov and scipy.linalg.sqrtm, as pytorch-fid computes it."""
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    covmean = linalg.sqrtm(s1 @ s2).real
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2 - 2 * covmean))


class _Identity:
    def __call__(self, images):
        return np.asarray(images, np.float64).reshape(len(images), -1)


def test_frechet_distance_matches_the_closed_form_and_a_direct_computation():
    # one dimension: (m1 - m2)^2 + (s1 - s2)^2
    assert frechet_distance([1.0], [[4.0]], [3.0], [[9.0]]) == pytest.approx(4 + 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 8))
    y = rng.standard_normal((300, 8)) @ rng.standard_normal((8, 8)) * 0.5 + 0.3
    ours = frechet_distance(x.mean(0), np.cov(x, rowvar=False), y.mean(0), np.cov(y, rowvar=False))
    assert ours == pytest.approx(_direct_fid(x, y), rel=1e-9)
    assert ours > 1.0


def test_fid_accumulated_over_batches_equals_fid_of_all_features_at_once():
    rng = np.random.default_rng(1)
    real = rng.standard_normal((120, 2, 2, 3))
    fake = 0.8 * rng.standard_normal((120, 2, 2, 3)) + 0.2
    metric = FID(_Identity())
    accumulator = metric.empty()
    for start in range(0, 120, 25):  # a short last batch too
        accumulator = metric.update(accumulator, {"samples": fake[start:start + 25],
                                                  "images": real[start:start + 25]})
    value = metric.result(accumulator)["fid"]
    assert value == pytest.approx(_direct_fid(fake.reshape(120, -1), real.reshape(120, -1)), rel=1e-7)
    moments = FeatureMoments().add(fake.reshape(120, -1)[:50]).add(fake.reshape(120, -1)[50:])
    np.testing.assert_allclose(moments.cov, np.cov(fake.reshape(120, -1), rowvar=False), atol=1e-12)
    # precomputed reference statistics give the same score
    flat = real.reshape(120, -1)
    stats = (flat.mean(0), np.cov(flat, rowvar=False))
    again = FID(_Identity(), reference=stats)
    acc = again.update(again.empty(), {"samples": fake})
    assert again.result(acc)["fid"] == pytest.approx(value, rel=1e-7)


def test_fid_is_near_zero_for_identical_sets_and_grows_with_a_shift(tmp_path):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    features = RandomConvFeatures(seed=0, dim=16)
    metric = FID(features)

    def score(samples):
        accumulator = metric.empty()
        for start in range(0, 64, 16):
            accumulator = metric.update(accumulator, {"samples": samples[start:start + 16],
                                                      "images": images[start:start + 16]})
        return metric.result(accumulator)["fid"]

    same = score(images)
    brighter = score(np.clip(images.astype(int) + 60, 0, 255).astype(np.uint8))
    much_brighter = score(np.clip(images.astype(int) + 120, 0, 255).astype(np.uint8))
    assert abs(same) < 1e-6
    assert brighter > 1e-3 and much_brighter > brighter
    # near-singular covariances (fewer images than feature dimensions) still give a finite score
    few = FID(RandomConvFeatures(seed=0, dim=64))
    acc = few.update(few.empty(), {"samples": images[:8], "images": images[8:16]})
    assert np.isfinite(few.result(acc)["fid"])
    np.savez(tmp_path / "stats.npz", mu=np.zeros(2), sigma=np.eye(2))
    from_file = FID(_Identity(), reference=str(tmp_path / "stats.npz"))
    acc = from_file.update(from_file.empty(), {"samples": rng.standard_normal((50, 1, 1, 2))})
    assert np.isfinite(from_file.result(acc)["fid"])


def test_random_conv_features_are_fixed_by_the_seed():
    images = np.random.default_rng(0).integers(0, 256, (3, 12, 12, 3), dtype=np.uint8)
    first = RandomConvFeatures(seed=5, dim=32)(images)
    assert first.shape == (3, 32)
    np.testing.assert_array_equal(RandomConvFeatures(seed=5, dim=32)(images), first)
    assert not np.allclose(RandomConvFeatures(seed=6, dim=32)(images), first)
    floats = images.astype(np.float32) / 127.5 - 1  # floats are read as [-1, 1]
    np.testing.assert_allclose(RandomConvFeatures(seed=5, dim=32)(floats), first, atol=1e-5)
    assert RandomConvFeatures(seed=5)(images[..., :1]).shape == (3, 64)


# ----------------------------------------------------------------------------------------------
# Inception


@pytest.fixture(scope="module")
def inception_state() -> dict[str, np.ndarray]:
    """Random weights in pytorch-fid's names and layouts (the shapes come from the Flax port)."""
    from dew.eval.inception import random_torch_state

    return random_torch_state(0)


def _port_tensors(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors the port reads: the file's minus the classifier and the batch-norm counters."""
    return {k: v for k, v in state.items() if not k.startswith("fc.") and not k.endswith("num_batches_tracked")}


def test_inception_port_has_pytorch_fids_tensors_and_gives_2048_features(tmp_path, inception_state):
    state = dict(inception_state)
    # pytorch-fid's network: 94 conv+bn units (5 tensors each) and 21,785,568 weights outside fc;
    # the classifier ("fc.*") and the batch-norm counters are in its file too, and ignored
    port = _port_tensors(state)
    assert len(port) == 94 * 5 and len(state) == 94 * 6 + 2
    learned = sum(v.size for k, v in port.items() if not k.endswith(("running_mean", "running_var")))
    assert learned == 21_785_568
    assert state["Conv2d_1a_3x3.conv.weight"].shape == (32, 3, 3, 3)
    assert state["Mixed_7c.branch3x3_2b.conv.weight"].shape == (384, 384, 3, 1)
    assert state["fc.weight"].shape == (1008, 2048)
    np.savez(tmp_path / "inception.npz", **state)
    features = InceptionFeatures(tmp_path / "inception.npz", size=75)
    images = np.random.default_rng(0).integers(0, 256, (2, 20, 20, 3), dtype=np.uint8)
    out = features(images)
    assert out.shape == (2, 2048) and np.all(np.isfinite(out)) and np.all(out >= 0)  # after ReLU
    assert not np.allclose(out[0], out[1])
    np.testing.assert_allclose(features(images[::-1]), out[::-1], rtol=1e-4, atol=1e-4)


def test_inception_weights_errors_name_the_file_and_the_tensor(tmp_path, inception_state):
    from dew.eval.inception import variables_from_torch

    with pytest.raises(FileNotFoundError, match="nowhere/pt_inception.npz.*never downloads"):
        InceptionFeatures(tmp_path / "nowhere" / "pt_inception.npz")
    state = dict(inception_state)
    del state["Mixed_6e.branch7x7dbl_3.bn.running_var"]
    np.savez(tmp_path / "partial.npz", **state)
    with pytest.raises(ValueError, match=r"partial\.npz lacks 1 tensors.*Mixed_6e\.branch7x7dbl_3\.bn\.running_var"):
        InceptionFeatures(tmp_path / "partial.npz")
    state = dict(inception_state)
    state["Mixed_5b.branch1x1.conv.weight"] = state["Mixed_5b.branch1x1.conv.weight"][:, :7]
    with pytest.raises(ValueError, match="wrong.npz: 'Mixed_5b.branch1x1.conv.weight'.*shape"):
        variables_from_torch(state, "wrong.npz")
    state = dict(inception_state, **{"Mixed_5b.extra.conv.weight": np.zeros((1, 1, 1, 1))})
    with pytest.raises(ValueError, match="does not have.*Mixed_5b.extra.conv.weight"):
        variables_from_torch(state, "extra.npz")
    with pytest.raises(ValueError, match="'Mixed_5b.branch1x1.weight', which is not a tensor"):
        variables_from_torch({"Mixed_5b.branch1x1.weight": np.zeros(1)}, "odd.npz")
    round_trip = torch_state_from_variables(variables_from_torch(inception_state))
    port = _port_tensors(inception_state)
    assert sorted(round_trip) == sorted(port)
    for name, value in port.items():
        np.testing.assert_array_equal(round_trip[name], value)


def test_inception_reads_safetensors_too(tmp_path):
    from safetensors.numpy import save_file

    from dew.eval.inception import read_tensors

    tensors = {"a.conv.weight": np.arange(6, dtype=np.float32).reshape(1, 2, 3, 1),
               "b": np.asarray([1.5], np.float64)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    read = read_tensors(tmp_path / "w.safetensors")
    for name, value in tensors.items():
        np.testing.assert_array_equal(read[name], value)


# ----------------------------------------------------------------------------------------------
# Grids and the evaluation pass


def test_image_grid_tiles_in_rows_and_save_writes_a_png_atomically(tmp_path):
    images = np.stack([np.full((4, 5, 3), 10 * (i + 1), np.uint8) for i in range(5)])
    grid = image_grid(images)
    assert grid.shape == (2 * 4, 3 * 5, 3) and grid.dtype == np.uint8
    assert grid[0, 0, 0] == 10 and grid[0, 10, 0] == 30 and grid[4, 5, 0] == 50 and grid[4, 10, 0] == 0
    assert image_grid(images, rows=1).shape == (4, 25, 3)
    floats = image_grid(np.asarray([[[[-1.0]], [[1.0]]]]))
    assert floats.tolist() == [[[0]], [[255]]]
    path = save_image_grid(images, tmp_path / "out" / "samples.png", rows=5)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), image_grid(images, rows=5))
    assert sorted(p.name for p in path.parent.iterdir()) == ["samples.png"]


def test_metrics_score_a_validation_pass_through_evaluation():
    import jax

    from dew.data import Digits
    from dew.eval.evaluation import Evaluation
    from dew.objectives.base import Objective

    class Echo(Objective):
        def init(self, key, variables=None):
            return {"params": {}}

        def loss(self, variables, batch, step):
            raise NotImplementedError

        def evaluate(self, variables, batch, step):
            images = batch["image"].astype(jax.numpy.float32) / 127.5 - 1
            return {"samples": images, "images": images}

    data = Digits(image_size=16, channels=3).load(batch=90)
    result = Evaluation.run(
        Echo(), {"params": {}}, data.val, key=jax.random.key(0),
        metrics=(FID(RandomConvFeatures(seed=0, dim=8)), SSIM()),
    )
    assert abs(result.scores["val/fid"]) < 1e-6 and result.scores["val/ssim"] == pytest.approx(1.0)
    assert result.batches == 4
