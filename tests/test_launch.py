"""Several processes as one run: `dew launch` and `prepare_process`, on this machine's CPU.

Two processes with two simulated devices each train as one MeshSpec(fsdp=4) and match one process
with four devices; their checkpoint restores in this (single) process on another mesh; a failing
rank stops the others; --dry-run prints the ssh, srun and gcloud commands exactly."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, MeshSpec, Trainer
from dew.cli import launch
from dew.data import TokenWindows
from dew.data.corpora import help_topics_text
from dew.data.tokens import tokenize
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.training.runtime import PoolSettings, prepare_process

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "pool_train.py"


def dew_launch(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO / "src")
    return subprocess.run([sys.executable, "-m", "dew.cli.main", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pool")
    (directory / "corpus.txt").write_text(help_topics_text()[:20_000])
    tokenize(directory / "corpus.txt", directory / "tokens", "byte", val_fraction=0.1)
    return directory


def pool_run(tokens, name, processes, devices):
    result = tokens / name
    run = dew_launch("--processes-per-host", str(processes), "--env", "JAX_PLATFORMS=cpu",
                     "--env", f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}",
                     "--env", f"DEW_TOKEN_DIR={tokens / 'tokens'}", "--env", f"DEW_CHECKPOINT_DIR={tokens / name}-run",
                     "--env", f"DEW_RESULT={result}", "--env", "DEW_STEPS=4", "--", sys.executable, str(SCRIPT))
    assert run.returncode == 0, run.stdout[-3000:]
    return [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(processes)], run.stdout


def test_two_processes_train_as_one_mesh_and_restore_in_one(tokens):
    pool, output = pool_run(tokens, "two", processes=2, devices=2)
    alone, _ = pool_run(tokens, "one", processes=1, devices=4)
    assert [(r["process"], r["processes"], r["devices"]) for r in pool] == [(0, 2, 4), (1, 2, 4)]
    assert "[0] " in output and "[1] " in output  # each line labelled with its rank
    assert len(pool[0]["losses"]) == 4 and pool[0]["updates"] == 4
    np.testing.assert_allclose(pool[0]["losses"], alone[0]["losses"], rtol=1e-5)
    np.testing.assert_allclose(pool[1]["losses"], alone[0]["losses"], rtol=1e-5)
    # four prompts, each process passing its own two: each gets its own rows back, drawn with the keys
    # of their global rows, so together they are the single process's four
    assert len(pool[0]["rows"]) == len(pool[1]["rows"]) == 2 and len(alone[0]["rows"]) == 4
    assert pool[0]["rows"] + pool[1]["rows"] == alone[0]["rows"]
    assert pool[0]["rows"] != pool[1]["rows"]

    # the checkpoint the pool wrote restores here: one process, eight devices, fsdp=2 x data=4
    model = CausalTransformer(vocab_size=256, emb_features=32, num_layers=2, num_heads=4, mlp_features=64, max_seq_len=32)
    checkpoints = Checkpoints(tokens / "two-run")
    trainer = Trainer(LMObjective(model, seq_len=16), optax.adam(1e-2), key=jax.random.key(0),
                      mesh=MeshSpec(fsdp=2), checkpoints=checkpoints)
    restored = trainer.fit(TokenWindows(path=str(tokens / "tokens"), seq_len=16).load(batch=8), steps=4)
    other = Checkpoints(tokens / "one-run")
    reference = Trainer(LMObjective(model, seq_len=16), optax.adam(1e-2), key=jax.random.key(0),
                        checkpoints=other).fit(TokenWindows(path=str(tokens / "tokens"), seq_len=16).load(batch=8), steps=4)
    assert int(restored.step) == 4
    for a, b in zip(jax.tree_util.tree_leaves(restored.params), jax.tree_util.tree_leaves(reference.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_a_failing_rank_stops_the_others(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['DEW_PROCESS_ID'])\n"
        "open(os.path.join(sys.argv[1], f'pid.{rank}'), 'w').write(str(os.getpid()))\n"
        "print('started', flush=True)\n"
        "if rank == 1:\n    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    began = time.monotonic()
    run = dew_launch("--processes-per-host", "2", "--", sys.executable, str(script), str(tmp_path), timeout=60)
    assert run.returncode == 3 and time.monotonic() - began < 40
    assert "[0] started" in run.stdout and "[1] started" in run.stdout
    assert "process 1 exited with status 3" in run.stdout
    survivor = int((tmp_path / "pid.0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(survivor, 0)  # rank 0 was stopped, not left sleeping


def test_dry_run_prints_the_exact_commands():
    ssh = launch.plan(["/opt/py", "train.py"], hosts=["h1", "h2"], processes_per_host=2, env={"A": "b c"}, environ={})
    assert [p.label for p in ssh] == ["0", "1", "2", "3"]
    assert ssh[3].argv[:6] == ("ssh", "-tt", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10") and ssh[3].argv[6] == "h2"
    assert ssh[3].argv[7] == ("DEW_COORDINATOR_ADDRESS=h1:8476 DEW_NUM_PROCESSES=4 DEW_PROCESS_ID=3 A='b c' /opt/py train.py")
    slurm = launch.plan(["python", "t.py"], processes_per_host=4, environ={"SLURM_JOB_ID": "7"})
    assert slurm[0].shell() == "srun --label --kill-on-bad-exit=1 --ntasks-per-node=4 env python t.py"
    tpu = launch.plan(["python", "g.py"], tpu="dew-16", zone="us-central2-b", env={"DEW_MODEL": "m"}, environ={})
    assert tpu[0].argv == ("gcloud", "compute", "tpus", "tpu-vm", "ssh", "dew-16", "--zone=us-central2-b", "--worker=all",
                           "--command=DEW_MODEL=m python g.py")
    gpus = launch.plan(["python", "t.py"], processes_per_host=2, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [p.env["DEW_LOCAL_DEVICE_IDS"] for p in gpus] == ["0,1", "2,3"]
    printed = dew_launch("--processes-per-host", "2", "--port", "9999", "--dry-run", "--", "python", "x.py")
    assert printed.returncode == 0
    assert printed.stdout.splitlines() == [
        f"[{r}] DEW_COORDINATOR_ADDRESS=127.0.0.1:9999 DEW_NUM_PROCESSES=2 DEW_PROCESS_ID={r} python x.py" for r in (0, 1)]


def test_bad_launches_and_late_joins_are_clear_errors():
    with pytest.raises(ValueError, match="--zone"):
        launch.plan(["python"], tpu="t", environ={})
    with pytest.raises(ValueError, match="NAME=VALUE"):
        launch.parse_env(["=x"])
    with pytest.raises(ValueError, match="after --"):
        launch.plan([], environ={})
    with pytest.raises(ValueError, match="do not split"):
        launch.plan(["python"], processes_per_host=3, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match="DEW_NUM_PROCESSES"):
        PoolSettings.from_environment({"DEW_COORDINATOR_ADDRESS": "127.0.0.1:1", "DEW_PROCESS_ID": "0"})
    jax.devices()  # this process's backend has started
    with pytest.raises(RuntimeError, match="before any device array"):
        prepare_process(multi_host=True)
    no_pool = subprocess.run(
        [sys.executable, "-c", "from dew.training.runtime import prepare_process; prepare_process(multi_host=True)"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO / "src"), "JAX_PLATFORMS": "cpu"})
    assert no_pool.returncode != 0 and "found no process pool" in no_pool.stderr


@pytest.mark.slow
def test_the_multihost_example_rehearses_on_two_cpu_processes(tokens):
    """The README's rehearsal of examples/train_multihost.py: two processes of two simulated devices."""
    run = dew_launch("--processes-per-host", "2", "--env", "JAX_PLATFORMS=cpu",
                     "--env", "XLA_FLAGS=--xla_force_host_platform_device_count=2", "--env", "DEW_STEPS=3",
                     "--env", f"DEW_TOKEN_DIR={tokens / 'tokens'}", "--env", f"DEW_CHECKPOINT_DIR={tokens / 'example-run'}",
                     "--", sys.executable, str(REPO / "examples" / "train_multihost.py"))
    assert run.returncode == 0, run.stdout[-3000:]
    assert "[0] Process 0: 3 updates" in run.stdout and "[1] Process 1: 3 updates" in run.stdout
