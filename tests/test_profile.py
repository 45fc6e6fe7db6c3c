"""dew.Profiler captures and the Trainer's ProfileWindow, read back with JAX's own XPlane reader."""

import glob
import json
import sys

import jax
import optax
import pytest

from dew import Profiler, ProfileWindow, Trainer
from dew.telemetry.profile import capture_options, hlo_protos
from dew.tracking import ProfileCaptured, Tracker
from test_trainer import Linear, linear_data


class Memory(Tracker):
    def __init__(self):
        self.logged = []

    def log(self, data, step=None):
        self.logged.append(data)


def trace_of(capture):
    """(the step numbers of the "train" step markers, the distinct executions of each program)
    in a capture's XPlane trace."""
    (path,) = glob.glob(str(capture / "plugins" / "profile" / "*" / "*.xplane.pb"))
    marked, runs = [], {}
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if event.name == "train" and "step_num" in stats:
                    marked.append(int(stats["step_num"]))
                if "hlo_module" in stats:
                    runs.setdefault(stats["hlo_module"], set()).add(stats.get("run_id"))
    return sorted(marked), {name: len(ids) for name, ids in runs.items()}


def test_a_profiler_around_a_fit_captures_the_train_step_with_its_manifest(tmp_path):
    trainer = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0))
    with Profiler(tmp_path / "profiles") as profiler:
        trainer.fit(linear_data(), steps=4, log_every=4)
    (capture,) = profiler.captures
    assert capture.parent == tmp_path / "profiles" and capture.name.startswith("capture-")
    _, runs = trace_of(capture)
    assert runs.get("jit__train_step") == 4  # every step of the fit ran inside the capture

    manifest = json.loads((capture / "manifest.json").read_text())
    assert manifest == profiler.manifest
    assert manifest["backend"] == "cpu" and manifest["versions"]["jax"] == jax.__version__
    assert manifest["options"]["python_tracer_level"] == 0  # Python tracing is off by default
    assert manifest["traces"] and (capture / manifest["traces"][0]).exists()
    assert manifest["reports"]["trace_events"]["available"]
    assert (capture / manifest["reports"]["trace_events"]["file"]).exists()
    for name in ("overview_page", "kernel_stats", "memory_profile"):
        report = manifest["reports"][name]
        assert report["available"] or "reason" in report
    # XLA:CPU keeps no memory counters: recorded as missing, not as zero.
    assert manifest["counters"]["cpu:0/peak_bytes_in_use"] == {
        "missing": "the cpu backend does not report peak_bytes_in_use"
    }
    assert manifest["view_command"] == f"xprof --logdir={capture}"
    # The step was compiled inside the capture, so its StableHLO is there.
    (step_hlo,) = [name for name in manifest["hlo"] if "jit__train_step" in name]
    assert "stablehlo" in (capture / step_hlo).read_text() and jax.config.values["jax_dump_ir_to"] == ""

    # start/stop makes a second capture beside the first, which is kept.
    profiler.start()
    trainer.fit(linear_data(), steps=6, log_every=2)
    second = profiler.stop()
    assert second != capture and profiler.captures == [capture, second] and (capture / "manifest.json").exists()
    assert trace_of(second)[1].get("jit__train_step") == 6  # no checkpoints: the fit starts again at 0


def test_xprof_converts_a_capture_into_its_reports_and_its_absence_is_said(tmp_path, monkeypatch):
    pytest.importorskip("xprof.convert", reason="XProf is not installed (the profile extra)")
    trainer = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0))
    with Profiler(tmp_path / "with") as profiler:
        trainer.fit(linear_data(), steps=3, log_every=3)
    (capture,) = profiler.captures
    reports = profiler.manifest["reports"]
    # XProf read this capture: its host op table holds the fit's Grain reads, three steps' worth.
    assert reports["framework_op_stats"]["available"]
    (table, *_) = json.loads((capture / reports["framework_op_stats"]["file"]).read_text())
    operations = {row["c"][3]["v"]: row["c"][4]["v"] for row in table["rows"]}
    assert any(name.endswith("__getitem__") and occurrences >= 3 for name, occurrences in operations.items())
    assert reports["input_pipeline_analyzer"]["available"]
    # A report XProf does not build for XLA:CPU is listed as missing, with why.
    assert reports["kernel_stats"] == {"available": False, "reason": "XProf offers no kernel_stats for this backend"}

    monkeypatch.setitem(sys.modules, "xprof.convert", None)  # as if the extra were not installed
    with Profiler(tmp_path / "without") as bare:
        trainer.fit(linear_data(), steps=1, log_every=1)
    missing = bare.manifest["reports"]["overview_page"]
    assert not missing["available"] and "pip install 'dewml[profile]'" in missing["reason"]
    assert bare.manifest["reports"]["trace_events"]["available"]


def test_a_profiler_without_a_directory_makes_one_and_one_capture_runs_at_a_time(tmp_path):
    profiler = Profiler(options={"python_tracer_level": 1})
    assert profiler.directory is None
    capture = profiler.start()
    try:
        assert profiler.directory is not None and capture.parent == profiler.directory
        with pytest.raises(RuntimeError, match="already running"):
            Profiler(tmp_path).start()
    finally:
        profiler.stop()
    assert profiler.manifest["options"]["python_tracer_level"] == 1
    with pytest.raises(RuntimeError, match="start"):
        profiler.stop()
    with pytest.raises(ValueError, match="python_tracing_level"):
        capture_options(python_tracing_level=1)
    with pytest.raises(TypeError, match="ProfileOptions"):
        Profiler(tmp_path, options=3)


def test_a_profile_window_traces_exactly_its_steps_and_reports_them(tmp_path):
    tracker = Memory()
    window = ProfileWindow(tmp_path / "window", steps=3, warmup=2)
    trainer = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), tracker=tracker, profile=window)
    trainer.fit(linear_data(), steps=8, log_every=4)

    (record,) = [r for r in tracker.logged if isinstance(r, ProfileCaptured)]
    assert (record.first_step, record.last_step) == (3, 5)
    capture = tmp_path / "window" / record.directory.rsplit("/", 1)[1]
    assert [p.name for p in (tmp_path / "window").iterdir()] == [capture.name]
    marked, runs = trace_of(capture)
    assert marked == [3, 4, 5]
    assert runs == {"jit__train_step": 3}  # neither the warm-up steps nor the ones after
    assert record.manifest["steps"] == {"first": 3, "last": 5}
    assert record.manifest["hlo"] == ["hlo/train_step.txt"]
    assert (capture / "hlo" / "train_step.txt").read_text().startswith("HloModule jit__train_step")

    # Each fit traces its own window into a new capture beside the earlier one.
    trainer.fit(linear_data(), steps=8, log_every=4)
    assert len([r for r in tracker.logged if isinstance(r, ProfileCaptured)]) == 2
    assert len(list((tmp_path / "window").iterdir())) == 2


def test_a_window_past_the_end_or_inside_a_profiler_fails_before_training(tmp_path):
    trainer = Trainer(
        Linear(), optax.sgd(0.05), key=jax.random.key(0), profile=ProfileWindow(tmp_path / "late", steps=3, warmup=6)
    )
    with pytest.raises(ValueError, match=r"traces steps 7\.\.9, but this fit runs steps 1\.\.8"):
        trainer.fit(linear_data(), steps=8)
    assert trainer.history == [] and not (tmp_path / "late").exists()

    inside = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), profile=ProfileWindow(tmp_path / "w", steps=1))
    with Profiler(tmp_path / "outer"):
        with pytest.raises(RuntimeError, match="not both"):
            inside.fit(linear_data(), steps=4)
    assert inside.history == []
    with pytest.raises(ValueError, match="ProfileWindow.steps"):
        ProfileWindow(tmp_path, steps=0)
    with pytest.raises(TypeError, match="ProfileWindow"):
        Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), profile=tmp_path)


# ----------------------------------------------------------------------------------------------
# The HLO protos GPU and TPU traces carry, found in a hand-built XSpace.


def _field(number, value):
    def varint(n):
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def test_hlo_protos_are_read_from_the_metadata_plane():
    stat_names = _field(5, _field(1, 7) + _field(2, _field(1, 7) + _field(2, b"hlo_proto")))
    other_stat = _field(5, _field(1, 8) + _field(2, _field(1, 8) + _field(2, b"program_id")))
    program = _field(1, 3) + _field(2, b"jit_step(3)")
    program += _field(5, _field(1, 8) + _field(4, 3))  # an int stat that is not the proto
    program += _field(5, _field(1, 7) + _field(6, b"\x0a\x03HLO"))
    metadata_plane = _field(2, b"/host:metadata") + stat_names + other_stat + _field(4, _field(1, 3) + _field(2, program))
    device_plane = _field(2, b"/device:GPU:0") + stat_names + _field(4, _field(1, 3) + _field(2, program))
    xspace = _field(1, device_plane) + _field(1, metadata_plane) + _field(4, b"host")
    assert hlo_protos(xspace) == {"jit_step(3)": b"\x0a\x03HLO"}
    assert hlo_protos(_field(1, device_plane)) == {}


def test_a_run_that_stops_inside_the_window_ends_its_trace(tmp_path):
    from dew.telemetry.profile import running_capture
    from test_trainer import Exploding

    window = ProfileWindow(tmp_path / "window", steps=4, warmup=3)  # steps 4..7; step 5 goes NaN
    trainer = Trainer(Exploding(), optax.sgd(0.1), key=jax.random.key(0), profile=window)
    with pytest.raises(FloatingPointError, match="step 5"):
        trainer.fit(linear_data(), steps=10, log_every=100)
    assert running_capture() is None
    (capture,) = (tmp_path / "window").iterdir()
    manifest = json.loads((capture / "manifest.json").read_text())
    assert manifest["steps"] == {"first": 4, "stopped_early": True}
    after = Profiler(tmp_path / "after")  # a new capture can start: the window's trace ended
    after.start()
    assert after.stop().exists()
