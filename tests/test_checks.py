"""dew.checks.count: one check, one message, for every count and size Dew takes."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dew import Dataset, Loading, MeshSpec
from dew.checks import count, count_fields, one_of
from dew.data.images import Digits
from dew.data.tokens import TokenWindows
from dew.diffusion.schedules import KarrasSchedule
from dew.eval.image_metrics import image_grid
from dew.eval.probes import KnnProbe, LinearProbe
from dew.nn.backbones.layer_plan import LayerKind
from dew.objectives.jepa import MultiBlockMask
from dew.rl import group_advantages, rloo_advantages


def test_count_accepts_python_and_numpy_integers_and_returns_a_python_int():
    for value in (3, np.int64(3), np.int32(3), np.uint8(3)):
        got = count(value, "steps")
        assert got == 3 and type(got) is int
    assert count(0, "seed", minimum=0) == 0
    assert count(None, "top_k", optional=True) is None


@pytest.mark.parametrize("value", [0, -1, 2.0, 2.5, True, False, "3", None, np.float32(2.0), np.array([2])])
def test_count_refuses_what_is_not_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"^steps must be a positive integer; got .* \(\w+\)\.$"):
        count(value, "steps")


def test_count_names_its_bound_and_optional():
    with pytest.raises(ValueError, match=r"seq_len must be an integer >= 2; got 1 \(int\)\."):
        count(1, "seq_len", minimum=2)
    with pytest.raises(ValueError, match=r"top_k must be a positive integer or None; got 0 \(int\)\."):
        count(0, "top_k", optional=True)
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0; got -1"):
        count(-1, "seed", minimum=0)


def test_count_fields_checks_and_stores_the_named_fields():
    @dataclasses.dataclass(frozen=True)
    class Grid:
        rows: int
        seed: int = 0

        def __post_init__(self):
            count_fields(self, rows=1, seed=0)

    grid = Grid(np.int64(4), np.int32(0))
    assert (grid.rows, grid.seed) == (4, 0) and type(grid.rows) is int and type(grid.seed) is int
    with pytest.raises(ValueError, match=r"Grid.rows must be a positive integer; got 0"):
        Grid(0)
    with pytest.raises(ValueError, match=r"Grid.seed must be an integer >= 0; got True"):
        Grid(1, True)


# Call sites: NumPy integers pass (and come back as ints), whole floats and bools do not, and the
# message names the argument at that site.
SITES = [
    ("Dataset.batch", lambda n: Dataset(train=lambda partition: iter(()), batch=n).batch),
    ("Loading.threads", lambda n: Loading(threads=n).threads),
    ("MeshSpec.fsdp", lambda n: MeshSpec(fsdp=n).fsdp),
    ("TokenWindows.seq_len", lambda n: TokenWindows(seq_len=n).seq_len),
    ("Digits.image_size", lambda n: Digits(image_size=n).image_size),
    ("KnnProbe.k", lambda n: KnnProbe(num_classes=10, k=n).k),
    ("LinearProbe.labels_per_class", lambda n: LinearProbe(num_classes=10, labels_per_class=n).labels_per_class),
    ("LayerKind.window", lambda n: LayerKind(window=n).window),
    ("MultiBlockMask.num_targets", lambda n: MultiBlockMask.for_grid((8, 8), num_targets=n).num_targets),
    ("image_grid rows", lambda n: image_grid(np.zeros((4, 2, 2, 1), np.uint8), rows=n).shape[0] // 2),
    ("steps", lambda n: KarrasSchedule().grid(n).shape[0] - 1),
]


@pytest.mark.parametrize("name, build", SITES, ids=[name for name, _ in SITES])
def test_call_sites_accept_numpy_integers_and_refuse_floats_and_bools(name, build):
    got = build(np.int64(2))
    assert got == 2 and type(got) is int
    for bad in (2.0, True):
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer(?: or None)?; got {bad!r}"):
            build(bad)


def test_group_advantages_take_numpy_group_counts_and_refuse_floats():
    rewards = jnp.asarray([1.0, 0.0, 2.0, 2.0])
    np.testing.assert_allclose(rloo_advantages(rewards, np.int64(2)), [1.0, -1.0, 0.0, 0.0])
    np.testing.assert_allclose(group_advantages(rewards, np.int64(2), normalize=False), [0.5, -0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"groups \(responses per prompt\) must be a positive integer; got 2.0"):
        group_advantages(rewards, 2.0)
    with pytest.raises(ValueError, match=r"rloo_advantages groups .* must be an integer >= 2; got 1"):
        rloo_advantages(rewards, 1)


def test_one_of_returns_a_listed_value_and_names_every_choice_otherwise():
    assert one_of("b", ("a", "b"), "mode", what="a mode") == "b"
    with pytest.raises(ValueError, match=r"^mode='c' is not a mode; use one of 'a', 'b'$"):
        one_of("c", ("a", "b"), "mode", what="a mode")
    with pytest.raises(ValueError, match=r"use None \(off\) or one of 'a', 'b'$"):
        one_of("c", ("a", "b"), "mode", what="a mode", extra="None (off)")
