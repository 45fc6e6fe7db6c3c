"""benchmarks/harness.py: peers run without slowing settings, windows alternate, the best peer is
the denominator, and a configuration that cannot run is reported with its reason."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import harness  # noqa: E402

# A fake side: records its environment, fails when told to, and reports a window of 10 units in
# the seconds its configuration names (so the rates are known without timing anything).
FAKE = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {benchmarks!r})
import harness

SECONDS = {{"dew": 0.25, "defaults": 1.0, "1": 0.5, "compile": 2.0}}


class Fake(harness.Runner):
    def __init__(self, config):
        if config.get("compile") and config.get("fail_compile"):
            raise RuntimeError("no C compiler on this machine")
        self.config = config
        self.key = "dew" if config["side"] == "dew" else "compile" if config.get("compile") else \\
            "defaults" if config["threads"] is None else str(config["threads"])
        self.info = {{"env": {{name: os.environ.get(name) for name in harness.SLOWING}},
                      "pythonpath": os.environ.get("PYTHONPATH", "")}}
        self.windows = 0

    def window(self):
        with open(Path(self.config["workdir"]) / "order.txt", "a") as log:
            log.write(self.key + "\\n")
        self.windows += 1
        return SECONDS[self.key], 10.0

    def finish(self):
        return {{"windows": self.windows}}


harness.serve(harness.worker_config(), Fake)
"""


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    """The peer configurations of a 2-core machine (defaults, 1 thread, compile) on any machine."""
    monkeypatch.setattr(harness, "cores", lambda: 2)


@pytest.fixture
def fake_script(tmp_path):
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE.format(benchmarks=str(BENCHMARKS)))
    return str(script)


def fake_sides(script, **config):
    dew = harness.side("dew", "dew", script, [], {"side": "dew", **config})
    peers = harness.torch_sides(script, [], {"side": "torch", **config}, compile=True)
    return [dew, *peers]


def test_thread_counts_below_the_core_count():
    assert harness.thread_counts(2) == [1]
    assert harness.thread_counts(8) == [1, 2, 4]
    assert harness.thread_counts(1) == []


def test_one_configuration_runs_the_loss_check_at_one_thread():
    sides = harness.torch_sides("bench.py", [], {"side": "torch"}, compile=True)
    assert [s.name for s in sides if s.config.get("loss_run")] == ["torch 1 thread"]


def test_peers_never_run_with_a_slowing_setting(fake_script, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sides = fake_sides(fake_script)
    # negative control: a side given the caller's environment as it is records the settings
    control = harness.side("torch as set", "peer", fake_script, [], {"side": "torch", "threads": None},
                           env=dict(__import__("os").environ))
    result = harness.compare([*sides, control], repeats=1, workdir=tmp_path, progress=lambda _: None)
    recorded = {o.name: o.info["env"] for o in result.outcomes}
    assert recorded["torch as set"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert recorded["torch as set"]["GOMP_SPINCOUNT"] == "0"
    for name in ("dew", "torch defaults", "torch 1 thread", "torch.compile defaults"):
        assert all(value is None for value in recorded[name].values()), (name, recorded[name])
    dew_info = next(o.info for o in result.outcomes if o.name == "dew")
    assert dew_info["pythonpath"].split(":")[0] == str(harness.SRC)


def test_windows_alternate_and_the_ratio_is_against_the_fastest_peer(fake_script, tmp_path):
    result = harness.compare(fake_sides(fake_script), repeats=4, workdir=tmp_path, progress=lambda _: None)
    order = (tmp_path / "order.txt").read_text().split()
    sides = ["dew", "defaults", "1", "compile"]
    # every round runs each side once, the starting side rotating
    assert order == [s for r in range(4) for s in sides[r:] + sides[:r]]
    assert result.order[:4] == ["dew", "torch defaults", "torch 1 thread", "torch.compile defaults"]
    assert result.dew.rate == pytest.approx(40.0)
    assert result.best_peer.name == "torch 1 thread"  # 10 units in 0.5 s beats 1.0 s and 2.0 s
    assert result.ratio == pytest.approx(2.0)
    report = result.report("units_per_s")
    assert report["peer_units_per_s_by_config"] == {
        "torch defaults": 10.0, "torch 1 thread": 20.0, "torch.compile defaults": 5.0}
    assert report["dew_over_best_peer"] == 2.0
    assert all(o.finished == {"windows": 4} for o in result.outcomes)


def test_a_configuration_that_cannot_run_is_reported_with_its_reason(fake_script, tmp_path):
    result = harness.compare(fake_sides(fake_script, fail_compile=True), repeats=2, workdir=tmp_path,
                             progress=lambda _: None)
    compiled = next(o for o in result.outcomes if o.name == "torch.compile defaults")
    assert compiled.rate is None and "no C compiler" in compiled.unavailable
    report = result.report("units_per_s")
    assert report["peer_units_per_s_by_config"]["torch.compile defaults"].startswith("unavailable: RuntimeError")
    assert report["best_peer"] == "torch 1 thread"
    assert "compile" not in (tmp_path / "order.txt").read_text().split()
    json.dumps(report)  # printable as the benchmark's JSON line


def test_compare_needs_one_dew_side(fake_script):
    peers = harness.torch_sides(fake_script, [], {"side": "torch"}, compile=False)
    with pytest.raises(ValueError, match="exactly one Dew side"):
        harness.compare(peers, repeats=1)
