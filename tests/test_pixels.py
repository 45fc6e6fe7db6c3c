"""dew.pixels: the one conversion between uint8 batches and [-1, 1] model pixels, used everywhere."""

import io

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from dew.inference.image import Images
from dew.pixels import png_bytes, to_uint8, to_unit_range
from dew.tracking import LocalTracker
from dew.tracking.records import Artifact

LEVELS = np.arange(256, dtype=np.uint8)


def test_uint8_levels_map_onto_minus_one_to_one_and_back_exactly():
    unit = to_unit_range(LEVELS)
    assert unit.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(unit)[[0, 255]], [-1.0, 1.0], rtol=0, atol=2e-7)
    np.testing.assert_allclose(np.diff(np.asarray(unit)), 2.0 / 255.0, rtol=0, atol=4e-7)
    np.testing.assert_array_equal(to_uint8(unit), LEVELS)


def test_floats_are_taken_as_model_pixels_and_uint8_passes_through():
    floats = np.array([-1.0, 0.0, 1.0], np.float64)
    np.testing.assert_array_equal(to_unit_range(floats), floats.astype(np.float32))
    assert to_uint8(LEVELS) is LEVELS or np.shares_memory(to_uint8(LEVELS), LEVELS)


def test_to_uint8_clips_and_rounds_to_the_nearest_level():
    # 0.0 sits at 127.5, which rounds half to even (128); a hair either side picks the neighbour
    values = np.array([-3.0, -1.0, -0.0001, 0.0, 0.0001, 1.0, 7.0], np.float32)
    np.testing.assert_array_equal(to_uint8(values), [0, 0, 127, 128, 128, 255, 255])


def test_to_unit_range_traces_under_jit():
    traced = jax.jit(to_unit_range)(jnp.asarray(LEVELS))
    np.testing.assert_allclose(traced, to_unit_range(LEVELS), rtol=0, atol=2e-7)
    np.testing.assert_array_equal(to_uint8(traced), LEVELS)


def test_every_writer_reads_back_the_same_pixels(tmp_path):
    drawn = np.linspace(-1.2, 1.2, 2 * 4 * 4 * 3, dtype=np.float32).reshape(2, 4, 4, 3)
    expected = to_uint8(drawn)
    np.testing.assert_array_equal(Images(drawn).uint8(), expected)
    decoded = np.asarray(Image.open(io.BytesIO(png_bytes(drawn[0]))))
    np.testing.assert_array_equal(decoded, expected[0])
    grey = np.asarray(Image.open(io.BytesIO(png_bytes(drawn[0, ..., :1]))))
    assert grey.shape == (4, 4)
    np.testing.assert_array_equal(grey, expected[0, ..., 0])

    tracker = LocalTracker(tmp_path / "track", plots=False)
    path = tracker.artifact(Artifact("sample", "image", drawn[1]), step=3)
    tracker.close()
    np.testing.assert_array_equal(np.asarray(Image.open(path)), expected[1])
    assert sorted(p.name for p in path.parent.iterdir()) == ["sample-00000003.png"]
