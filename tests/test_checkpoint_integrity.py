"""Checkpoint integrity: digests catch damaged steps, resume falls back to an intact one, and a
failed write says what happened and leaves nothing half-written."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import dew
from dew import Aux, Checkpoints, Dataset, Field, InputSpec, Objective, Trainer
from dew.cli.main import main as dew_main
from dew.tracking import Tracker
from dew.training.checkpoints import CheckpointCorrupted
from dew.training.digests import named_arrays
from test_checkpoints import assert_states_equal


class Wide(Objective):
    """A 64x64 Dense layer fit to tanh: enough bytes that a flipped bit lands inside array data."""

    model = nn.Dense(64)
    inputs = InputSpec(Field("x", (64,)), Field("y", (64,)))
    ema_decay = 0.9

    def init(self, key, variables=None):
        return self.model.init(key, jnp.ones((1, 64)))

    def loss(self, variables, batch, step):
        return jnp.mean((self.model.apply(variables, batch["x"]) - batch["y"]) ** 2), Aux()


def wide_data():
    x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    return Dataset.from_records({"x": x, "y": np.tanh(x)}, batch=8)


class Records(Tracker):
    def __init__(self):
        self.records = []

    def log(self, data, step=None):
        if not isinstance(data, dict):
            self.records.append(data)


def wide_trainer(directory, tracker=None):
    return Trainer(Wide(), optax.adam(0.01), key=jax.random.key(0),
                   checkpoints=Checkpoints(directory, keep=None), tracker=tracker)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Steps 10, 20 and 30 of the Wide run; each test damages its own copy."""
    directory = tmp_path_factory.mktemp("saved") / "run"
    trainer = wide_trainer(directory)
    trainer.fit(wide_data(), steps=30, log_every=30, checkpoint_every=10)
    return directory


@pytest.fixture
def run(saved_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


def data_files(step_directory):
    """The files that hold a step's array data (Orbax's OCDBT data files)."""
    files = [p for p in (step_directory / "state").rglob("*") if p.parent.name == "d"]
    return sorted(files, key=lambda p: p.stat().st_size)


def read_without_digests(directory, step):
    """What Orbax alone returns for a step: no digest is checked."""
    manager = ocp.CheckpointManager(directory, item_names=("state",))
    tree = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(None)))["state"]
    manager.close()
    return dict(named_arrays(tree))


def flip_a_bit_that_reads_silently(directory, step):
    """Flip one bit of the step's largest data file at the first place from its middle where Orbax
    still reads the step without error but returns a changed array; returns that array's name."""
    saved = read_without_digests(directory, step)
    target = data_files(directory / str(step))[-1]
    original = target.read_bytes()
    for offset in range(len(original) // 2, len(original)):
        flipped = bytearray(original)
        flipped[offset] ^= 0x04
        target.write_bytes(bytes(flipped))
        try:
            read = read_without_digests(directory, step)
        except Exception:
            continue
        changed = [name for name in saved if not np.array_equal(saved[name], read[name])]
        if changed:
            assert len(changed) == 1
            return changed[0]
    raise AssertionError("no single-bit flip in the data file changed an array silently")


def test_a_flipped_bit_in_the_newest_step_is_found_and_fit_resumes_from_the_step_before(run, tmp_path):
    changed = flip_a_bit_that_reads_silently(run, 30)  # the negative control: Orbax alone sees nothing

    with pytest.raises(CheckpointCorrupted) as caught:
        Checkpoints(run).restore_variables()
    error = caught.value
    assert (error.step, error.item, error.array) == (30, "state", changed)
    assert error.expected.startswith("crc32:") and error.found.startswith("crc32:") and error.expected != error.found
    assert error.intact_steps == (10, 20)
    assert f"Checkpoint step 30 in {run} is damaged" in str(error) and error.expected in str(error)

    records = Records()
    resumed = wide_trainer(run, tracker=records)
    with pytest.warns(UserWarning, match=r"step 30 .* is damaged.*Resuming from step 20; set aside: 30.damaged"):
        state, _, restored_step = resumed.restore_or_init()
    assert restored_step == 20
    rejected = [r for r in records.records if type(r).__name__ == "CheckpointRejected"]
    assert [(r.step, r.restored_step) for r in rejected] == [(30, 20)] and changed in rejected[0].message
    assert Checkpoints(run).steps() == [10, 20] and (run / "30.damaged").is_dir()

    stopped_at_20 = wide_trainer(tmp_path / "straight20").fit(wide_data(), steps=20, log_every=20)
    assert_states_equal(state, stopped_at_20)  # bitwise the state of a run that stopped at step 20

    final = wide_trainer(run).fit(wide_data(), steps=40, log_every=40, checkpoint_every=10)
    straight = wide_trainer(tmp_path / "straight40").fit(wide_data(), steps=40, log_every=40)
    assert_states_equal(final, straight)
    assert Checkpoints(run).steps() == [10, 20, 30, 40] and Checkpoints(run).verify()[30] is None


def truncate_the_largest_data_file(step_directory):
    target = data_files(step_directory)[-1]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])


def remove_the_data_item(step_directory):
    shutil.rmtree(step_directory / "data")


def move_the_data_position(step_directory):
    path = step_directory / "data" / "metadata"
    item = json.loads(path.read_text())
    item["position"]["next_index"] += 1  # a valid position, one batch off
    path.write_text(json.dumps(item))


@pytest.mark.parametrize(
    "damage, item, array, found",
    [
        (truncate_the_largest_data_file, "state", None, "unreadable"),
        (remove_the_data_item, "data", None, "it is missing"),
        (move_the_data_position, "data", "position", "crc32:"),
    ],
)
def test_damage_is_reported_with_the_step_item_and_intact_steps(run, damage, item, array, found):
    damage(run / "30")
    with pytest.raises(CheckpointCorrupted) as caught:
        Checkpoints(run).restore_variables()
    error = caught.value
    assert (error.step, error.item) == (30, item)
    if array is not None:
        assert error.array == array
    assert error.found.startswith(found)
    assert error.intact_steps == (10, 20)
    message = str(error)
    assert f"step 30 in {run} is damaged: item {item!r}" in message and "Intact steps: [10, 20]" in message


def test_verify_lists_damaged_and_intact_steps_and_the_command_line_exits_nonzero(run, capsys):
    assert Checkpoints(run).verify() == {10: None, 20: None, 30: None}
    dew_main(["checkpoints", "verify", str(run)])
    assert capsys.readouterr().out.splitlines() == [
        "step 10: intact", "step 20: intact", "step 30: intact", "3 of 3 steps intact."]

    truncate_the_largest_data_file(run / "20")
    report = Checkpoints(run).verify()
    assert report[10] is None and report[30] is None
    assert report[20].step == 20 and report[20].item == "state" and report[20].found.startswith("unreadable")
    assert Checkpoints(run).verify(step=30) == {30: None}
    with pytest.raises(SystemExit) as exited:
        dew_main(["checkpoints", "verify", str(run)])
    assert exited.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 10: intact" and lines[2] == "step 30: intact"
    assert lines[1].startswith("step 20: DAMAGED: item 'state'")
    assert lines[3] == "1 of 3 steps damaged; the newest intact step is 30."


def test_a_run_whose_every_step_is_damaged_refuses_to_resume(run):
    for step in (10, 20, 30):
        remove_the_data_item(run / str(step))
    with pytest.raises(CheckpointCorrupted, match="No intact step remains"):
        wide_trainer(run).fit(wide_data(), steps=40, log_every=40)


def test_an_older_step_that_keeps_its_position_as_a_pickle_is_refused_and_resumes_without_it(run, tmp_path):
    import base64
    import pickle

    class Plant:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "planted",))

    # What an older Dew wrote: no digests item, the position as base64 of a pickle.
    step = run / "30"
    shutil.rmtree(step / "digests")
    metadata = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    del metadata["item_handlers"]["digests"]
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))
    payload = base64.b64encode(pickle.dumps(Plant())).decode()
    (step / "data" / "metadata").write_text(json.dumps({"position": {"pickle": payload}}))

    with pytest.raises(ValueError, match=r"step 30 .* keeps its data position as a pickle.*restore_position=False"):
        wide_trainer(run).fit(wide_data(), steps=40, log_every=40)
    assert not (tmp_path / "planted").exists()

    resumed = Trainer(Wide(), optax.adam(0.01), key=jax.random.key(0),
                      checkpoints=Checkpoints(run, keep=None, restore_position=False))
    resumed.fit(wide_data(), steps=31, log_every=31)
    assert [h["step"] for h in resumed.history] == [31]
    assert not (tmp_path / "planted").exists()


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory):
    """A saved decoder run (run.json beside step 30), as dew.pipeline and dew export read it."""
    from test_runs import pattern_run

    directory = tmp_path_factory.mktemp("decoder") / "run"
    pattern_run(directory)
    return directory


def test_pipeline_and_export_refuse_a_damaged_step_and_name_the_intact_ones(decoder_run, tmp_path, capsys):
    from dew.interop import PretrainedDecoder

    run = tmp_path / "run"
    shutil.copytree(decoder_run, run)
    shutil.copytree(run / "30", run / "20")  # a second, intact step (an older copy of the same weights)
    truncate_the_largest_data_file(run / "30")
    for load in (lambda: dew.pipeline(run), lambda: PretrainedDecoder.from_run(run)):
        with pytest.raises(CheckpointCorrupted, match=r"step 30 .* is damaged.*Intact steps: \[20\]"):
            load()
    with pytest.raises(SystemExit) as exited:
        dew_main(["export", str(run), str(tmp_path / "hf")])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("dew: error: Checkpoint step 30") and "Intact steps: [20]" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    assert dew.pipeline(run, step=20) is not None  # the intact step still loads when asked for


FULL_DISK_RUN = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    import conftest  # the same CPU device set-up as the tests
    import jax, numpy as np, optax
    from dew import Checkpoints, Trainer
    from dew.tracking import Tracker
    from dew.training.checkpoints import CheckpointSaveFailed
    from test_trainer import Linear, linear_data

    directory, steps, fill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    checkpoints = Checkpoints(directory, keep=None)

    class FillTheDisk(Tracker):
        def log(self, data, step=None):
            if type(data).__name__ == "Failure":
                print("RECORD Failure", data.step, data.last_checkpoint, flush=True)
            if type(data).__name__ == "CheckpointSaved" and data.step == fill_after:
                checkpoints.wait()
                with open(os.path.join(os.path.dirname(directory), "filler"), "wb", buffering=0) as filler:
                    for size in (1 << 16, 1 << 12, 1):  # down to the last byte
                        try:
                            while True:
                                filler.write(bytes(size))
                        except OSError:
                            pass

    trainer = Trainer(Linear(ema_decay=0.9), optax.adam(0.05), key=jax.random.key(7),
                      checkpoints=checkpoints, tracker=FillTheDisk())
    try:
        state = trainer.fit(linear_data(), steps=steps, log_every=steps, checkpoint_every=10)
    except CheckpointSaveFailed as failed:
        print("FAILED", failed, flush=True)
        sys.exit(3)
    print("started at", trainer.history[0]["step"] - 1, flush=True)
    np.savez(sys.argv[4], **jax.device_get(state.params))
    """
)


def test_a_full_disk_stops_the_run_with_a_clear_error_and_the_next_run_resumes(tmp_path):
    """On a 1 MiB tmpfs (mounted in a private mount namespace), the disk is filled once step 10 is
    written, so step 20 fails with ENOSPC from the kernel; then space is freed and the run resumes."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare to mount a small tmpfs")
    script = tmp_path / "run.py"
    script.write_text(FULL_DISK_RUN.format(tests=str(Path(__file__).parent)))
    disk = tmp_path / "disk"
    disk.mkdir()
    python = sys.executable
    shell = textwrap.dedent(
        f"""
        set -u
        mount -t tmpfs -o size=1m tmpfs {disk} || exit 97
        {python} {script} {disk}/run 30 10 {tmp_path}/unused.npz > {tmp_path}/first.out 2> {tmp_path}/first.err
        echo $? > {tmp_path}/first.rc
        ls -a {disk}/run > {tmp_path}/after_failure.ls
        rm {disk}/filler
        {python} {script} {disk}/run 30 0 {tmp_path}/resumed.npz > {tmp_path}/second.out 2> {tmp_path}/second.err
        echo $? > {tmp_path}/second.rc
        """
    )
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    outcome = subprocess.run([*namespace, "sh", "-c", shell], capture_output=True, text=True, timeout=600)
    if outcome.returncode == 97 or "unshare:" in outcome.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {outcome.stderr.strip()}")

    first_out = (tmp_path / "first.out").read_text()
    first_err = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "3", first_err
    assert (
        f"FAILED Could not write checkpoint step 20 to {disk}/run: No space left on device (ENOSPC). "
        "Its partial files were removed. The newest complete step is 10; a run started again resumes from it."
    ) in first_out
    assert "RECORD Failure 20 10" in first_out  # the tracker heard of it too
    assert "Traceback" not in first_err and "ERROR" not in first_err, first_err  # no absl or asyncio noise
    assert (tmp_path / "after_failure.ls").read_text().split() == [".", "..", "10"]  # no partial step 20

    assert (tmp_path / "second.rc").read_text().strip() == "0", (tmp_path / "second.err").read_text()
    assert "started at 10" in (tmp_path / "second.out").read_text()
    straight = make_straight_run(tmp_path / "straight")
    resumed = np.load(tmp_path / "resumed.npz")
    for name in straight:
        assert np.array_equal(straight[name], resumed[name]), name


def make_straight_run(directory):
    from test_trainer import Linear, linear_data

    state = Trainer(Linear(ema_decay=0.9), optax.adam(0.05), key=jax.random.key(7)).fit(
        linear_data(), steps=30, log_every=30)
    return jax.device_get(state.params)
