"""RunConfig.sweep: trials as real runs, a ledger that survives a kill and resumes, failures recorded,
Grid/Random/Optuna searches, and bad input refused before anything trains."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dew.config import ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dew.config.sweep import GridSearch, IntRange, Ledger, OptunaSearch, RandomSearch, Uniform
from dew.data import TokenWindows
from dew.nn.backbones import CausalTransformer
from dew.tracking import LocalTracker, Tracker

ROOT = Path(__file__).resolve().parents[1]

# The program of the spec's "Sweeping a hyperparameter" section, after the batches, model and objective
# of its "Standalone evaluation" section that it continues.
SPEC_PROGRAM = '''
import itertools

import jax
import numpy as np
import optax

from dew import Dataset, Evaluation, LocalTracker, Trainer
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective, Perplexity, Samples
from dew.sampling import Sampling

row = np.resize(np.array([1, 2, 3, 4], dtype=np.int32), 17)
batch = {"text": np.tile(row, (8, 1))}
data = Dataset(
    train=lambda partition: itertools.repeat(batch),
    val=lambda partition: iter([batch]),
    records=8,
    batch=8,
)
model = CausalTransformer(
    vocab_size=8,
    emb_features=32,
    num_layers=1,
    num_heads=2,
    mlp_features=64,
    max_seq_len=32,
)
objective = LMObjective(
    model,
    seq_len=16,
    samples=Samples([1, 2], 8, sampling=Sampling(temperature=0)),
)

from dew import Evaluation, LocalTracker
from dew.config import ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dew.config.sweep import GridSearch
from dew.data import TokenWindows

config = RunConfig(
    # The run records the model it trains, and the batches above stand in
    # for the dataset this names.
    model=ModelConfig.from_model(objective.model),
    data=TokenWindows(seq_len=16),
    optim=OptimConfig(optimizer="adam"),
    trainer=TrainerConfig(name="lm-rate", checkpoint_dir="runs/sweep", steps=40, batch_size=8,
                          eval_every=None, checkpoint_every=None),
)


def trial(run: RunConfig) -> float:
    """Train one point and score it: the perplexity its own run ends on."""
    state = run.train(objective, data, name=run.trainer.name or "lm-rate")
    return float(Evaluation.run(objective, state.variables, data.val, metrics=(Perplexity(),),
                                key=jax.random.key(1), step=int(state.step)).scores["val/perplexity"])


with LocalTracker("runs/sweep/tracking") as tracker:
    trials = config.sweep({"optim.learning_rate": [0.01, 0.003]}, train=trial, trials=2,
                          ledger="runs/sweep/ledger.json", tracker=tracker, search=GridSearch())
best = min(trials, key=lambda trial: trial.value)
print(best.overrides, round(best.value, 4))
'''


def test_the_spec_sweep_program_prints_the_better_learning_rate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__sweep__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(SPEC_PROGRAM, "sweep-program", "exec"), namespace)
    overrides, value = printed.getvalue().strip().splitlines()[-1].rsplit(" ", 1)
    assert overrides == "{'optim.learning_rate': 0.01}"
    trials = namespace["trials"]
    assert [t.overrides["optim.learning_rate"] for t in trials] == [0.01, 0.003]
    assert 1.0 < float(value) < trials[1].value < 1.5  # the slower rate ends further from a perplexity of 1
    for index in (0, 1):  # each trial a run of its own, reloadable
        run = tmp_path / "runs/sweep/lm-rate" / f"trial-{index}"
        assert sorted(p.name for p in run.iterdir()) == ["40", "run.json", "tracking"]
        assert json.loads((run / "run.json").read_text())["optim"]["learning_rate"] == [0.01, 0.003][index]
    reports = [json.loads(line) for line in (tmp_path / "runs/sweep/tracking/records.jsonl").read_text().splitlines()]
    assert [(r["record"], r["index"], r["status"]) for r in reports] == [("SweepTrial", 0, "finished"),
                                                                      ("SweepTrial", 1, "finished")]


# --- a sweep killed after its first trial ------------------------------------------------------------

CHILD = '''
import itertools, json, os, sys, time
import numpy as np
from dew import Dataset
from dew.config import ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective

root = sys.argv[1]
pause = float(os.environ.get("BATCH_PAUSE", "0"))
batch = {"text": np.tile(np.resize(np.array([1, 2, 3, 4], np.int32), 9), (8, 1))}

def batches(partition):
    for _ in itertools.count():
        time.sleep(pause)  # a slow data source: the first run is killed while a trial trains
        yield batch

data = Dataset(train=batches, val=None, records=8, batch=8)
model = CausalTransformer(vocab_size=8, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, max_seq_len=16)
objective = LMObjective(model, seq_len=8)
config = RunConfig(model=ModelConfig.from_model(model), optim=OptimConfig(optimizer="adam"),
                   trainer=TrainerConfig(name="rates", checkpoint_dir=root, steps=8, batch_size=8, log_every=8))

def trial(run):
    with open(os.path.join(root, "trained.log"), "a") as log:
        log.write(f"{os.getpid()} {run.trainer.name}\\n")
    state = run.train(objective, data)
    return float(objective.loss(state.variables, {"text": batch["text"]}, None)[0])

trials = config.sweep({"optim.learning_rate": [0.01, 0.003]}, train=trial)
print(json.dumps([[t.index, t.value] for t in trials]))
'''


@pytest.mark.slow  # two processes, four real trials; test_an_interrupted_sweep_resumes... covers it quickly
def test_a_sweep_killed_after_its_first_trial_resumes_and_trains_only_the_rest(tmp_path):
    script = tmp_path / "sweep_child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    ledger = tmp_path / "rates" / "ledger.json"
    first = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**env, "BATCH_PAUSE": "0.4"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        def first_finished_second_started():
            trials = Ledger.read(ledger).trials if ledger.exists() else {}
            return 1 in trials and trials[0].status == "finished"

        while not first_finished_second_started():
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the first trial never finished"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    killed = Ledger.read(ledger).trials
    assert killed[0].status == "finished" and killed[1].status == "running"  # stopped inside trial 1
    first_value = killed[0].value

    second = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    finished = json.loads(second.stdout.strip().splitlines()[-1])
    assert [index for index, _ in finished] == [0, 1] and finished[0][1] == first_value
    trained = [line.split() for line in (tmp_path / "trained.log").read_text().splitlines()]
    resumed_pid = trained[-1][0]
    assert [name for pid, name in trained if pid == resumed_pid] == ["trial-1"]  # not trial-0 again
    assert [name for pid, name in trained if pid != resumed_pid] == ["trial-0", "trial-1"]
    for index in range(2):
        assert (tmp_path / "rates" / f"trial-{index}" / "8").is_dir()


# --- the ledger, searches and failures, with a cheap train function ---------------------------------------


def base_config(tmp_path, name="s"):
    model = CausalTransformer(vocab_size=8, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, max_seq_len=16)
    return RunConfig(model=ModelConfig.from_model(model), data=TokenWindows(seq_len=8),
                     optim=OptimConfig(optimizer="adam"),
                     trainer=TrainerConfig(name=name, checkpoint_dir=str(tmp_path), steps=4, batch_size=8))


class Calls:
    """A train function that scores a point without training and remembers every call."""

    def __init__(self, fail_at=()):
        self.seen, self.fail_at = [], set(fail_at)

    def __call__(self, run):
        self.seen.append(run)
        if run.optim.learning_rate in self.fail_at:
            raise FloatingPointError(f"diverged at {run.optim.learning_rate}")
        return (run.optim.learning_rate - 0.01) ** 2 + run.trainer.steps * 1e-3


class LedgerWatcher(Tracker):
    """At each sweep report, reads the ledger to see whether the trial reported is already in it."""

    def __init__(self, path):
        self.path, self.on_disk = path, []

    def log(self, data, step=None):
        if type(data).__name__ == "SweepTrial":
            self.on_disk.append(Ledger.read(self.path).trials[data.index].status == data.status)


def test_trials_get_their_own_run_directories_and_reach_the_ledger_before_the_tracker(tmp_path):
    config = base_config(tmp_path)
    calls = Calls()
    watcher = LedgerWatcher(tmp_path / "s" / "ledger.json")
    trials = config.sweep({"optim.learning_rate": [0.1, 0.01], "trainer.steps": [4, 6]}, train=calls, tracker=watcher,
                          search=GridSearch())
    assert [t.overrides for t in trials] == [
        {"optim.learning_rate": 0.1, "trainer.steps": 4}, {"optim.learning_rate": 0.1, "trainer.steps": 6},
        {"optim.learning_rate": 0.01, "trainer.steps": 4}, {"optim.learning_rate": 0.01, "trainer.steps": 6}]
    assert [(r.trainer.checkpoint_dir, r.trainer.name) for r in calls.seen] == [
        (str(tmp_path / "s"), f"trial-{i}") for i in range(4)]
    assert [(r.optim.learning_rate, r.trainer.steps) for r in calls.seen] == [(0.1, 4), (0.1, 6), (0.01, 4), (0.01, 6)]
    assert watcher.on_disk == [True] * 4
    assert min(trials, key=lambda t: t.value).overrides == {"optim.learning_rate": 0.01, "trainer.steps": 4}
    # called again: everything is in the ledger, nothing is trained
    again = Calls()
    assert config.sweep({"optim.learning_rate": [0.1, 0.01], "trainer.steps": [4, 6]}, train=again) == trials
    assert again.seen == []


def test_an_interrupted_sweep_resumes_and_trains_only_the_unfinished_trials(tmp_path):
    config = base_config(tmp_path)
    space = {"optim.learning_rate": [0.1, 0.01, 0.001]}

    def interrupted(run):
        if run.trainer.name == "trial-1":
            raise KeyboardInterrupt  # stops the sweep itself, as a kill would, leaving trial 1 started
        return 1.0

    with pytest.raises(KeyboardInterrupt):
        config.sweep(space, train=interrupted)
    left = Ledger.read(tmp_path / "s" / "ledger.json").trials
    assert [(i, t.status) for i, t in sorted(left.items())] == [(0, "finished"), (1, "running")]
    calls = Calls()
    trials = config.sweep(space, train=calls)
    assert [run.trainer.name for run in calls.seen] == ["trial-1", "trial-2"]
    assert [t.value for t in trials][0] == 1.0 and [t.index for t in trials] == [0, 1, 2]


def test_a_failed_trial_is_recorded_and_the_sweep_goes_on(tmp_path):
    config = base_config(tmp_path)
    space = {"optim.learning_rate": [1.0, 0.01, 0.001]}
    with LocalTracker(tmp_path / "tracking", plots=False) as tracker, pytest.warns(UserWarning, match="trial 0"):
        trials = config.sweep(space, train=Calls(fail_at={1.0}), tracker=tracker)
    assert [t.index for t in trials] == [1, 2]
    failed = Ledger.read(tmp_path / "s" / "ledger.json").trials[0]
    assert failed.status == "failed" and failed.value is None and "FloatingPointError: diverged at 1.0" in failed.error
    reports = [json.loads(line) for line in (tmp_path / "tracking" / "records.jsonl").read_text().splitlines()]
    assert [(r["index"], r["status"]) for r in reports] == [(0, "failed"), (1, "finished"), (2, "finished")]
    # a failed trial stays failed on resume unless asked again; then it runs with its recorded point
    calls = Calls()
    config.sweep(space, train=calls)
    assert calls.seen == []
    retried = config.sweep(space, train=calls, retry_failed=True)
    assert [r.optim.learning_rate for r in calls.seen] == [1.0] and [t.index for t in retried] == [0, 1, 2]
    # a train function that returns no number fails its trial, not the sweep
    with pytest.warns(UserWarning, match="returns a finite number"):
        assert base_config(tmp_path, "nan").sweep(space, train=lambda run: float("nan")) == []


def test_random_search_draws_reproducible_points_inside_the_space(tmp_path):
    space = {"optim.learning_rate": Uniform(1e-4, 1e-1, log=True), "trainer.steps": IntRange(2, 5),
             "optim.optimizer": ["adam", "sgd"]}
    first = base_config(tmp_path, "a").sweep(space, train=Calls(), trials=6, search=RandomSearch(seed=3))
    second = base_config(tmp_path, "b").sweep(space, train=Calls(), trials=6, search=RandomSearch(seed=3))
    other = base_config(tmp_path, "c").sweep(space, train=Calls(), trials=6, search=RandomSearch(seed=4))
    points = [t.overrides for t in first]
    assert points == [t.overrides for t in second] and points != [t.overrides for t in other]
    assert all(1e-4 <= p["optim.learning_rate"] <= 1e-1 and 2 <= p["trainer.steps"] <= 5 for p in points)
    assert {p["optim.optimizer"] for p in points} <= {"adam", "sgd"}
    # more trials later extend the same sequence
    calls = Calls()
    longer = base_config(tmp_path, "a").sweep(space, train=calls, trials=8, search=RandomSearch(seed=3))
    assert [t.overrides for t in longer[:6]] == points and len(calls.seen) == 2


def test_optuna_search_learns_and_resumes_from_the_ledger(tmp_path):
    pytest.importorskip("optuna")
    space = {"optim.learning_rate": Uniform(1e-4, 1e-1, log=True), "optim.optimizer": ["adam", "sgd"]}
    config = base_config(tmp_path)
    trials = config.sweep(space, train=Calls(), trials=12, search=OptunaSearch(seed=0))
    assert len(trials) == 12 and all(1e-4 <= t.overrides["optim.learning_rate"] <= 1e-1 for t in trials)
    assert {t.overrides["optim.optimizer"] for t in trials} <= {"adam", "sgd"}
    calls = Calls()
    more = config.sweep(space, train=calls, trials=14, search=OptunaSearch(seed=0))
    assert len(calls.seen) == 2 and more[:12] == trials
    with pytest.raises(ValueError, match="different sweep .*search"):
        config.sweep(space, train=calls, trials=14, search=OptunaSearch(direction="maximize"))


def test_bad_input_is_refused_before_any_trial_trains(tmp_path):
    config = base_config(tmp_path)
    calls = Calls()
    with pytest.raises(ValueError, match=r"'optim.learning_rat' names no setting.*Did you mean 'optim.learning_rate'"):
        config.sweep({"optim.learning_rat": [0.1]}, train=calls)
    with pytest.raises(ValueError, match=r"trainer has no 'stepz'.*'trainer.steps'"):
        config.sweep({"trainer.stepz": [1]}, train=calls)
    with pytest.raises(ValueError, match="'model.settings.width' names no setting"):
        config.sweep({"model.settings.width": [64]}, train=calls)
    with pytest.raises(TypeError, match=r"trainer.steps holds int; got 1.5"):
        config.sweep({"trainer.steps": [2, 1.5]}, train=calls)
    with pytest.raises(TypeError, match=r"trainer.steps holds int; got 2.0"):
        config.sweep({"trainer.steps": Uniform(2, 9)}, train=calls, trials=2, search=RandomSearch())
    with pytest.raises(ValueError, match="OptimConfig.optimizer must be one of"):
        config.sweep({"optim.optimizer": ["adam", "adagrad"]}, train=calls)
    with pytest.raises(ValueError, match="trainer.name cannot be swept"):
        config.sweep({"trainer.name": ["a", "b"]}, train=calls)
    with pytest.raises(TypeError, match="mixed types"):
        config.sweep({"optim.learning_rate": [0.01, "fast"]}, train=calls)
    with pytest.raises(ValueError, match="non-empty space"):
        config.sweep({}, train=calls)
    with pytest.raises(ValueError, match="no values"):
        config.sweep({"optim.learning_rate": []}, train=calls)
    with pytest.raises(TypeError, match="GridSearch takes lists"):
        config.sweep({"optim.learning_rate": Uniform(0.001, 0.1)}, train=calls)
    with pytest.raises(ValueError, match="grid has 2 points but trials=3"):
        config.sweep({"optim.learning_rate": [0.1, 0.01]}, train=calls, trials=3)
    with pytest.raises(ValueError, match="pass sweep"):
        config.sweep({"optim.learning_rate": [0.1]}, train=calls, search=RandomSearch())
    assert calls.seen == [] and not (tmp_path / "s").exists()
    # a ledger written by another sweep is refused, not mixed into this one
    config.sweep({"optim.learning_rate": [0.1]}, train=calls)
    with pytest.raises(ValueError, match="belongs to a different sweep \\(its space differ"):
        config.sweep({"optim.learning_rate": [0.2]}, train=calls)
    assert len(calls.seen) == 1


def test_a_model_setting_can_be_swept(tmp_path):
    calls = Calls()
    base_config(tmp_path).sweep({"model.settings.emb_features": [32, 64]}, train=calls)
    assert [run.model.build().emb_features for run in calls.seen] == [32, 64]


def test_optuna_search_without_optuna_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"dewml\[hpo\]"):
        base_config(tmp_path).sweep({"optim.learning_rate": [0.1]}, train=Calls(), trials=1, search=OptunaSearch())
