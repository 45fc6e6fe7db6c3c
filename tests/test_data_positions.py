"""Data positions are stored as JSON only: tagged values round-trip, Dew's iterators resume from a
JSON position, and a position JSON cannot hold stops a run before its first step."""

import ast
import json
import math
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, Dataset, Trainer
from dew.data import Loading, Partition, TokenWindows, tokenize
from dew.training import positions
from test_trainer import Linear, linear_data

SRC = Path(__file__).parent.parent / "src" / "dew"


def through_json(position):
    """What a checkpoint gives back: the position encoded, written as standard JSON, read, decoded."""
    return positions.decode(json.loads(json.dumps(positions.encode(position), allow_nan=False)))


def test_tagged_values_come_back_with_their_types():
    position = {
        "bytes": b"\x00\xffstate",
        "int64": np.int64(-3),
        "float32": np.float32(0.1),
        "flag": np.bool_(True),
        "array": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "floats": np.array([1.5, np.nan, -np.inf]),
        "tuple": (1, "two", (3.0,)),
        "int keys": {0: "a", 7: [1, 2]},
        "tag-like": {"__dew__": "bytes", "base64": "not a tag"},
        "nan": math.nan,
        "plain": [None, True, 2, 2.5, "text", {"nested": []}],
    }
    back = through_json(position)
    assert back.keys() == position.keys()
    assert back["bytes"] == b"\x00\xffstate"
    for name in ("int64", "float32", "flag"):
        assert type(back[name]) is type(position[name]) and back[name] == position[name]
    for name in ("array", "floats"):
        assert back[name].dtype == position[name].dtype and back[name].shape == position[name].shape
        np.testing.assert_array_equal(back[name], position[name])
    assert back["tuple"] == (1, "two", (3.0,)) and type(back["tuple"][2]) is tuple
    assert back["int keys"] == {0: "a", 7: [1, 2]}
    assert back["tag-like"] == {"__dew__": "bytes", "base64": "not a tag"}
    assert math.isnan(back["nan"])
    assert back["plain"] == position["plain"]


def test_a_value_json_cannot_hold_is_refused_naming_the_source_and_where_it_is():
    where = r"of MyIterator .* holds a builtins.object at position\['worker'\]\[1\]"
    with pytest.raises(positions.PositionNotStorable, match=where):
        positions.encode({"worker": [0, object()]}, source="MyIterator")
    with pytest.raises(positions.PositionNotStorable, match="numpy.ndarray"):
        positions.encode(np.array(["text"], dtype=object))


def assert_resumes_from_a_json_position(make_iterator):
    iterator = make_iterator()
    for _ in range(3):
        next(iterator)
    stored = json.dumps(positions.encode(iterator.get_state()), allow_nan=False)
    expected = [next(iterator) for _ in range(4)]
    fresh = make_iterator()
    first = next(fresh)
    fresh.set_state(positions.decode(json.loads(stored)))
    resumed = [next(fresh) for _ in range(4)]
    for a, b in zip(expected, resumed):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    assert not all(np.array_equal(first[k], expected[0][k]) for k in first)  # the position mattered


def test_a_grain_iterator_resumes_from_a_json_position():
    import grain

    stream = grain.MapDataset.range(40).shuffle(seed=3).repeat().batch(4).map(lambda ids: {"ids": ids})
    assert_resumes_from_a_json_position(lambda: iter(stream.to_iter_dataset()))


def test_a_from_records_iterator_resumes_from_a_json_position():
    assert_resumes_from_a_json_position(lambda: linear_data().train(Partition()))


def test_a_token_windows_iterator_resumes_from_a_json_position(tmp_path):
    (tmp_path / "in.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    tokenize(tmp_path / "in.txt", tmp_path / "tokens", "byte", val_fraction=0.0)
    data = TokenWindows(path=str(tmp_path / "tokens"), seq_len=8, seed=1, loading=Loading(workers=0)).load(batch=4)
    assert_resumes_from_a_json_position(lambda: data.train(Partition()))


def test_a_position_that_cannot_be_stored_stops_the_run_before_its_first_step(tmp_path):
    batches = linear_data().train(Partition())

    class Opaque:
        def __iter__(self):
            return self

        def __next__(self):
            return next(batches)

        def get_state(self):
            return {"cursor": object()}

        def set_state(self, state):
            pass

    trainer = Trainer(Linear(), optax.adam(0.05), key=jax.random.key(0),
                      checkpoints=Checkpoints(tmp_path / "run"))
    data = Dataset(train=lambda partition: Opaque(), records=64, batch=8)
    named = r"the Opaque that dataset.train returned.*position\['cursor'\]"
    with pytest.raises(positions.PositionNotStorable, match=named):
        trainer.fit(data, steps=4, log_every=4, checkpoint_every=2)
    assert trainer.history == [] and Checkpoints(tmp_path / "run").steps() == []


def test_no_module_of_dew_imports_pickle():
    unsafe = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.relative_to(SRC)}: {name}" for name in names if name.split(".")[0] in unsafe]
    assert found == []
