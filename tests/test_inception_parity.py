"""Dew's FID Inception-v3 against pytorch-fid 0.3.0's own pool3 features, on random weights.

tools/inception_fixtures.py ran pytorch-fid's real `InceptionV3([3])` (its construction, resize to
299, [0, 1] -> [-1, 1], FID blocks and pool3) with `random_torch_state(seed)` in place of the
downloaded weights, in an environment of its own, and recorded the features in
tests/fixtures/inception/. Here the same state, rebuilt with numpy from the seed, goes through an .npz
file into `InceptionFeatures`, as a user's converted weights would; no torch is needed. Batch norm has
random scales, shifts and running statistics, so the ported normalisation counts.

The negative controls are the same weights through torchvision's blocks, which differ from the FID
ones in their pools: the port must be far from each.
"""

import pathlib

import numpy as np
import pytest

from dew.eval.image_metrics import InceptionFeatures
from dew.eval.inception import random_torch_state

FIXTURE = pathlib.Path(__file__).parent / "fixtures/inception/reference.npz"

# pool3 features may differ from pytorch-fid's by this fraction of their largest value (float32 on
# both sides: the two libraries sum the convolutions in different orders)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def recorded() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as archive:
        return {name: archive[name] for name in archive.files}


@pytest.fixture(scope="module")
def dew_pool3(recorded, tmp_path_factory):
    """Dew's features of the recorded images of one size (computed once per size)."""
    path = tmp_path_factory.mktemp("inception") / "pt_inception-random.npz"
    np.savez(path, **random_torch_state(int(recorded["state_seed"])))
    features = InceptionFeatures(path)
    computed = {}

    def pool3(size: int) -> np.ndarray:
        if size not in computed:
            computed[size] = features(_images(int(recorded["image_seed"]), int(recorded["count"]), size))
        return computed[size]

    return pool3


def _images(seed: int, count: int, size: int) -> np.ndarray:
    """The rule tools/inception_fixtures.py's `images` recorded with."""
    return np.random.default_rng([seed, size]).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def _relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# 299: the resize is the identity on both sides; 32 (CIFAR-10) and 400: bilinear up- and downsampling
@pytest.mark.parametrize("size", [299, 32, 400])
def test_dew_matches_pytorch_fid_pool3_features(recorded, dew_pool3, size):
    want = recorded[f"features/{size}"]
    got = dew_pool3(size)
    assert got.shape == want.shape == (int(recorded["count"]), 2048)
    assert np.std(want) > 0.1 * np.max(np.abs(want))  # features that vary, not a constant
    assert _relative_difference(got, want) <= TOLERANCE


@pytest.mark.parametrize(
    "control",
    [
        "torchvision_blocks",  # all three FID differences at once
        "pools_count_padding",  # A, C and the first E average over padded zeros
        "mixed_7c_averages",  # the last block pools with an average instead of a max
    ],
)
def test_torchvisions_blocks_on_the_same_weights_are_far_from_dew(recorded, dew_pool3, control):
    got = dew_pool3(299)
    assert _relative_difference(got, recorded["features/299"]) <= TOLERANCE
    assert _relative_difference(got, recorded[f"controls/{control}"]) > 100 * TOLERANCE
