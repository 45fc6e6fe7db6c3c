"""Checkpoints: which steps are written, resuming to an absolute target, and crash safety."""

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, Dataset, Trainer
from test_trainer import Linear, linear_data


def make_trainer(directory, keep=None, ema_decay=0.9):
    return Trainer(
        Linear(ema_decay=ema_decay),
        optax.adam(0.05),
        key=jax.random.key(7),
        checkpoints=Checkpoints(directory, keep=keep),
    )


def assert_states_equal(a, b):
    same = jax.tree_util.tree_map(
        lambda x, y: np.array_equal(np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x),
                                    np.asarray(jax.random.key_data(y) if jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key) else y)),
        a,
        b,
    )
    assert all(jax.tree_util.tree_leaves(same))


def test_checkpoint_every_two_to_step_six_saves_steps_two_four_six(tmp_path):
    trainer = make_trainer(tmp_path / "run")
    trainer.fit(linear_data(), steps=6, log_every=3, checkpoint_every=2)
    trainer.checkpoints.wait()
    assert trainer.checkpoints.steps() == [2, 4, 6]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["2", "4", "6"]


def test_keep_bounds_the_steps_on_disk(tmp_path):
    trainer = make_trainer(tmp_path / "run", keep=2)
    trainer.fit(linear_data(), steps=8, log_every=8, checkpoint_every=2)
    trainer.checkpoints.wait()
    assert trainer.checkpoints.steps() == [6, 8]


def test_resume_is_an_absolute_target_and_matches_an_uninterrupted_run(tmp_path):
    straight = make_trainer(tmp_path / "straight").fit(linear_data(), steps=10, log_every=10)

    first = make_trainer(tmp_path / "resumed")
    first.fit(linear_data(), steps=4, log_every=4, checkpoint_every=4)
    first.checkpoints.wait()
    second = make_trainer(tmp_path / "resumed")
    resumed = second.fit(linear_data(), steps=10, log_every=10, checkpoint_every=5)
    assert [h["step"] for h in second.history] == list(range(5, 11))  # trained only the 6 missing steps
    assert int(resumed.step) == 10
    assert_states_equal(resumed, straight)


def test_resume_continues_from_the_saved_data_position(tmp_path):
    seen = []

    class Recording(Linear):
        pass

    def recorded(dataset):
        def train(partition):
            iterator = dataset.train(partition)

            class Spy:
                def __iter__(self):
                    return self

                def __next__(self):
                    batch = next(iterator)
                    seen.append(batch["x"][0, 0])
                    return batch

                def get_state(self):
                    return iterator.get_state()

                def set_state(self, state):
                    iterator.set_state(state)

            return Spy()

        return Dataset(train=train, records=dataset.records, batch=dataset.batch)

    trainer = make_trainer(tmp_path / "run")
    trainer.fit(recorded(linear_data()), steps=3, log_every=3, checkpoint_every=3)
    trainer.checkpoints.wait()
    make_trainer(tmp_path / "run").fit(recorded(linear_data()), steps=6, log_every=3)
    uninterrupted = []
    iterator = linear_data().train(__import__("dew").data.Partition())
    for _ in range(6):
        uninterrupted.append(next(iterator)["x"][0, 0])
    assert seen == uninterrupted


def test_a_target_below_the_restored_step_is_refused(tmp_path):
    trainer = make_trainer(tmp_path / "run")
    trainer.fit(linear_data(), steps=4, log_every=4, checkpoint_every=4)
    trainer.checkpoints.wait()
    with pytest.raises(ValueError, match=r"steps=2\) is below the restored step 4"):
        make_trainer(tmp_path / "run").fit(linear_data(), steps=2)
    state = make_trainer(tmp_path / "run").fit(linear_data(), steps=4)  # already there: no training
    assert int(state.step) == 4


def test_checkpoint_every_with_an_iterator_that_cannot_report_its_position_fails_before_training(tmp_path):
    batch = next(linear_data().train(__import__("dew").data.Partition()))
    data = Dataset(train=lambda partition: itertools.repeat(batch), records=8, batch=8)
    trainer = make_trainer(tmp_path / "run")
    with pytest.raises(ValueError, match="get_state and set_state.*repeat"):
        trainer.fit(data, steps=4, checkpoint_every=2)
    assert trainer.history == []


def test_a_half_written_checkpoint_is_never_restored(tmp_path):
    trainer = make_trainer(tmp_path / "run")
    trainer.fit(linear_data(), steps=2, log_every=2, checkpoint_every=2)
    trainer.checkpoints.wait()
    # what a crash in the middle of writing step 4 leaves: Orbax's temporary directory
    partial = tmp_path / "run" / "4.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00" * 10)
    assert Checkpoints(tmp_path / "run").steps() == [2]
    resumed = make_trainer(tmp_path / "run")
    resumed.fit(linear_data(), steps=3, log_every=3)
    assert [h["step"] for h in resumed.history] == [3]


KILLED_RUN = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    import conftest  # the same CPU device set-up as the tests
    import jax, numpy as np, optax
    from dew import Checkpoints, Trainer
    from dew.tracking import Tracker
    from test_trainer import Linear, linear_data

    class Announce(Tracker):
        def log(self, data, step=None):
            if type(data).__name__ == "CheckpointSaved":
                self.pending = data.step

    directory, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    checkpoints = Checkpoints(directory, keep=None)
    announce = Announce()
    trainer = Trainer(Linear(ema_decay=0.9), optax.adam(0.05), key=jax.random.key(7),
                      checkpoints=checkpoints, tracker=announce)
    original = checkpoints.save
    def save_then_report(state, position):
        original(state, position)
        checkpoints.wait()
        print("saved", int(state.step), flush=True)
        if os.environ.get("DEW_TEST_HANG_AFTER") == str(int(state.step)):
            import time
            time.sleep(600)  # wait here to be killed
    checkpoints.save = save_then_report
    state = trainer.fit(linear_data(), steps=steps, log_every=steps, checkpoint_every=every)
    checkpoints.wait()
    params = jax.device_get(state.params)
    np.savez(os.path.join(directory, "final.npz"), **{{k: v for k, v in params.items()}})
    print("done", flush=True)
    """
)


def test_a_run_killed_after_a_checkpoint_resumes_bitwise(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    straight = tmp_path / "straight"
    subprocess.run([sys.executable, str(script), str(straight), "9", "3"], check=True, env=env,
                   capture_output=True, timeout=300)

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, str(script), str(killed), "9", "3"],
        env={**env, "DEW_TEST_HANG_AFTER": "6"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.time() + 300
    for line in process.stdout:
        if line.startswith("saved 6") or time.time() > deadline:
            break
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert Checkpoints(killed).steps() == [3, 6]
    assert not (killed / "final.npz").exists()

    resumed = subprocess.run([sys.executable, str(script), str(killed), "9", "3"], check=True, env=env,
                             capture_output=True, text=True, timeout=300)
    assert "saved 9" in resumed.stdout and "saved 3" not in resumed.stdout
    a, b = np.load(straight / "final.npz"), np.load(killed / "final.npz")
    assert set(a) == set(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
