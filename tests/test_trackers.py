"""The tracker backends (TensorBoard, W&B, MLflow), each read back with its library's own reader,
and the rule that a failing tracker never stops training."""

import glob
import json
import struct
import warnings

import jax
import numpy as np
import optax
import pytest

from dew import Trackers, Trainer
from dew.tracking import Artifact, Failure, ProfileCaptured, SweepTrial, Tracker
from dew.tracking.base import TrackerWarning
from test_evaluation_tracking import Scored, split_data
from test_trainer import Linear, linear_data

IMAGE = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)


def short_fit(tracker):
    """Six steps of a tiny regression, logging at 3 and 6, evaluating (with a text preview) at 3
    and 6; then an image artifact, a sweep trial and a profile window, as a run's other parts
    would report them."""
    trainer = Trainer(Scored(), optax.sgd(0.05), key=jax.random.key(0), tracker=tracker)
    trainer.fit(split_data(), steps=6, log_every=3, eval_every=3, preview=True)
    tracker.artifact(Artifact("grid", "image", IMAGE), step=6)
    tracker.log(SweepTrial(index=1, params={"optim.learning_rate": 0.05}, status="finished", metric=0.25))
    tracker.log(ProfileCaptured(directory="/tmp/capture-1", first_step=4, last_step=5, manifest={}))
    tracker.log(Failure(step=6, message="disk quota", last_checkpoint=None))
    return trainer


def expected_losses(trainer):
    """The mean training loss over each logging window, from the trainer's own history."""
    rows = {row["step"]: row["loss"] for row in trainer.history}
    return {3: np.mean([rows[1], rows[2], rows[3]]), 6: np.mean([rows[4], rows[5], rows[6]])}


# ----------------------------------------------------------------------------------------------
# A failing tracker.


class Broken(Tracker):
    def __init__(self):
        self.calls = 0

    def log(self, data, step=None):
        self.calls += 1
        raise OSError(28, "No space left on device")


class Memory(Tracker):
    def __init__(self):
        self.logged = []

    def log(self, data, step=None):
        self.logged.append((data, step))


def test_a_tracker_that_raises_is_reported_once_and_training_goes_on():
    broken, memory = Broken(), Memory()
    trackers = Trackers(broken, memory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), tracker=trackers).fit(
            linear_data(), steps=6, log_every=2
        )
    assert int(state.step) == 6
    reported = [w for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(reported) == 1 and "No space left on device" in str(reported[0].message)
    assert broken.calls == len(trackers.failures) > 1  # every report was offered, only one warned
    assert [step for data, step in memory.logged if isinstance(data, dict)] == [2, 4, 6]


def test_a_lone_tracker_given_to_the_trainer_is_contained_too():
    with pytest.warns(TrackerWarning, match="Broken.log"):
        state = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), tracker=Broken()).fit(
            linear_data(), steps=2, log_every=1
        )
    assert int(state.step) == 2


# ----------------------------------------------------------------------------------------------
# TensorBoard, read with the event protocol buffers tensorboardX writes.


def read_events(directory):
    """Every summary value in the event files under `directory`, as (step, tag, value)."""
    from tensorboardX.proto import event_pb2

    values = []
    for path in sorted(glob.glob(str(directory / "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):  # TFRecord framing: length, its CRC, the event, its CRC
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    values.append((event.step, value.tag, value.simple_value))
                elif kind == "image":
                    values.append((event.step, value.tag, value.image))
                elif kind == "tensor":
                    values.append((event.step, value.tag, value.tensor.string_val[0].decode()))
    return values


def test_tensorboard_holds_scalars_at_their_steps_artifacts_and_the_run_configuration(tmp_path):
    pytest.importorskip("tensorboardX")
    from PIL import Image

    from dew import TensorBoardTracker

    with TensorBoardTracker(tmp_path / "events") as tracker:
        trainer = short_fit(tracker)
    events = read_events(tmp_path / "events")
    by_tag = {}
    for step, tag, value in events:
        by_tag.setdefault(tag, []).append((step, value))

    losses = expected_losses(trainer)
    assert [step for step, _ in by_tag["train/loss"]] == [3, 6]
    for step, value in by_tag["train/loss"]:
        assert value == pytest.approx(losses[step], rel=1e-5)
    assert [step for step, _ in by_tag["val/loss"]] == [3, 6]
    assert [step for step, _ in by_tag["progress/steps_per_second"]] == [3, 6]
    assert by_tag["sweep/metric"] == [(1, 0.25)]

    (config_step, config), = by_tag["run/config/text_summary"]
    assert config_step == 0 and json.loads(config)["batch"] == 8
    assert "Scored" in json.loads(config)["objective"]
    (_, profile), = by_tag["records/ProfileCaptured/text_summary"]
    assert json.loads(profile)["first_step"] == 4
    (failure_step, failure), = by_tag["records/Failure/text_summary"]
    assert failure_step == 6 and json.loads(failure)["message"] == "disk quota"

    previews = by_tag["weights/text_summary"]
    assert [step for step, _ in previews] == [3, 6] and previews[0][1].startswith("step 3")
    (image_step, image), = by_tag["grid"]
    assert image_step == 6 and (image.height, image.width) == (4, 5)
    import io

    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(image.encoded_image_string))), IMAGE)


# ----------------------------------------------------------------------------------------------
# MLflow, read with MLflow's own client from a sqlite store.


def test_mlflow_holds_metrics_at_their_steps_artifacts_and_the_run_configuration(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from dew import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with MLflowTracker("dew-test", uri=uri, run_name="short") as tracker:
        trainer = short_fit(tracker)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)

    losses = expected_losses(trainer)
    history = client.get_metric_history(tracker.run_id, "train/loss")
    assert [m.step for m in history] == [3, 6]
    for metric in history:
        assert metric.value == pytest.approx(losses[metric.step], rel=1e-5)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "val/loss")] == [3, 6]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "sweep/metric")] == [(1, 0.25)]
    assert run.data.params["batch"] == "8" and "Scored" in run.data.params["objective"]
    assert run.info.status == "FAILED" and run.data.tags["dew.failure"] == "disk quota"

    artifacts = tmp_path / "mlflow-artifacts"  # beside the database, not in the working directory
    files = {str(p.relative_to(artifacts)).split("/artifacts/", 1)[1] for p in artifacts.rglob("*") if p.is_file()}
    assert {"run/config.json", "weights/step-00000003.txt", "weights/step-00000006.txt"} <= files
    assert "records/ProfileCaptured-00000005.json" in files and "records/SweepTrial-00000001.json" in files
    config = json.loads(open(client.download_artifacts(tracker.run_id, "run/config.json", str(tmp_path))).read())
    assert config["batch"] == 8
    text = open(client.download_artifacts(tracker.run_id, "weights/step-00000003.txt", str(tmp_path))).read()
    assert text.startswith("step 3")
    (png,) = [f for f in files if f.startswith("images/grid+step+6+") and f.endswith(".png")]
    from PIL import Image

    np.testing.assert_array_equal(np.asarray(Image.open(client.download_artifacts(tracker.run_id, png, str(tmp_path)))), IMAGE)


# ----------------------------------------------------------------------------------------------
# W&B offline, read with wandb's own reader of the run's transaction log (`wandb leet inspect`).


@pytest.fixture
def wandb_offline(monkeypatch):
    """W&B offline and quiet, with any server address pointing at a closed local port."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def read_wandb_run(run_directory):
    """The records of an offline run's .wandb file, as wandb's inspector prints them."""
    import os
    import subprocess
    import sys

    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    printed = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(run_directory)], capture_output=True, text=True, check=True
    ).stdout
    return [json.loads(line) for line in printed.splitlines() if line.strip()]


def test_wandb_offline_holds_scalars_at_their_steps_artifacts_and_the_run_configuration(tmp_path, wandb_offline):
    pytest.importorskip("wandb")
    from dew import WandbTracker

    with WandbTracker("dew-test", directory=tmp_path / "wandb-runs", name="short") as tracker:
        trainer = short_fit(tracker)
    (run_directory,) = glob.glob(str(tmp_path / "wandb-runs" / "wandb" / "offline-run-*"))
    records = read_wandb_run(run_directory)

    rows = [r["history"] for r in records if r["type"] == "history"]
    by_step = {}
    for row in rows:
        if "step" in row:
            by_step.setdefault(row["step"]["num"], {}).update(row["item"])
    losses = expected_losses(trainer)
    assert sorted(step for step, item in by_step.items() if "train/loss" in item) == [3, 6]
    for step in (3, 6):
        assert by_step[step]["train/loss"] == pytest.approx(losses[step], rel=1e-5)
        assert "val/loss" in by_step[step] and by_step[step]["weights._type"] == "table-file"
    assert by_step[6]["grid._type"] == "image-file"
    assert (by_step[6]["grid.height"], by_step[6]["grid.width"]) == (4, 5)
    trial = [row["item"] for row in rows if "sweep/metric" in row["item"]]
    assert trial and trial[0]["sweep/trial"] == 1 and trial[0]["sweep/metric"] == 0.25

    config = {}
    for r in records:
        if r["type"] == "run":
            config.update(r["run"].get("config", {}).get("update", {}))
        elif r["type"] == "config":
            config.update(r["config"]["update"])
    assert config["batch"] == 8 and "Scored" in config["objective"]
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    assert summary["records/Failure"]["message"] == "disk quota"
    assert summary["records/ProfileCaptured"]["first_step"] == 4
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1]

    files = glob.glob(str(tmp_path / "wandb-runs" / "wandb" / "offline-run-*" / "files" / "media" / "*" / "*"))
    table = [f for f in files if "weights_3_" in f and f.endswith(".table.json")]
    assert json.load(open(table[0]))["data"][0][0].startswith("step 3")
    from PIL import Image

    (image,) = [f for f in files if "grid_6_" in f]
    np.testing.assert_array_equal(np.asarray(Image.open(image)), IMAGE)


@pytest.mark.parametrize(
    "make, module, extra",
    [
        (lambda tmp: __import__("dew").TensorBoardTracker(tmp), "tensorboardX", "tensorboard"),
        (lambda tmp: __import__("dew").WandbTracker("p", directory=tmp), "wandb", "wandb"),
        (lambda tmp: __import__("dew").MLflowTracker("e", uri=f"sqlite:///{tmp}/m.db"), "mlflow", "mlflow"),
    ],
)
def test_a_missing_backend_names_the_extra_to_install(tmp_path, monkeypatch, make, module, extra):
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    if module == "mlflow":
        monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=rf"pip install 'dewml\[{extra}\]'"):
        make(tmp_path)
