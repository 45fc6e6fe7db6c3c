"""Run each side of a benchmark in its own process, alternate their timed windows, rank the peers.

A comparison has one Dew side and several configurations of the peer (its library defaults, other
thread counts, `torch.compile`), each a worker process of the benchmark script itself
(`script.py ... --worker SPEC`). A worker sets itself up (builds the model, loads the shared
batches, compiles, warms up), says it is ready, then runs one timed window per request and, at the
end, returns what it measured besides (losses, samples). The parent starts the workers one at a
time, so no setup competes with another, then runs `repeats` rounds in which every live side runs
one window, the order rotating from round to round, and reports each side's median rate, every
peer configuration's figure and Dew's ratio against the fastest.

A peer runs as its users run it: its environment is the caller's minus every setting that changes
how OpenMP, BLAS or malloc wait, spin or size their thread pools (`SLOWING`), and its thread count,
when not the library's default, is set in the process through the library's own call. The
workers share nothing but files in a work directory the parent passes them (the same batches,
the same seed), so no side's threads compete with another's inside one process.

Workers speak one JSON object per line on stdout; everything a worker prints itself goes to its
log file, whose tail is reported when a configuration cannot run (it is then listed as
unavailable with the reason, never dropped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Settings that change how a library's threads wait, spin or how many there are, or how malloc
# behaves: OMP_WAIT_POLICY=PASSIVE halves torch's two-thread training speed on this machine. A peer
# runs without any of them (its thread count is set through the library's own call instead).
SLOWING = (
    "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_DYNAMIC", "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX", "LD_PRELOAD",
)


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def hardware() -> str:
    """The processor and the cores this process may run on, for a report."""
    import platform

    return f"{platform.processor() or platform.machine()}, {cores()} cores"


def set_peer_threads(config: dict) -> None:
    """Set torch's intra-op thread count to the configuration's ``threads`` (None: torch's default,
    one per core), in the peer's own process before it builds anything."""
    if config["threads"] is not None:
        import torch

        torch.set_num_threads(config["threads"])


def timed_calls(call: Callable[[], Any], calls: int) -> float:
    """Wall seconds of `calls` calls of `call` (each one waiting for its own result)."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return time.perf_counter() - start


def timed_fit(trainer, batches: Sequence, batch: int, steps: int) -> float:
    """Wall seconds of `trainer.fit` over `steps` steps of `batches` ("text" rows, cycled), as a
    user's fit call runs them (its log lines go to stderr, the worker's log)."""
    return fit_window(trainer, batches, batch, steps)[0]


def fit_window(trainer, batches: Sequence, batch: int, steps: int, *, column: str = "text",
               records: int | None = None) -> tuple[float, Any]:
    """`(seconds, state)` of one `trainer.fit` over `steps` steps of `batches`, each the `column`
    of a row, cycled; `records` is the dataset's size (``len(batches)`` by default)."""
    import itertools

    import jax

    from dew import Dataset

    rows = [{column: b} for b in batches]
    data = Dataset(train=lambda partition: itertools.cycle(rows),
                   records=len(rows) if records is None else records, batch=batch)
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        state = trainer.fit(data, steps=steps, log_every=steps)
    jax.block_until_ready(state)
    return time.perf_counter() - start, state


def peer_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without any setting in `SLOWING`: the peer at its defaults."""
    environ = dict(os.environ if environ is None else environ)
    return {name: value for name, value in environ.items() if name not in SLOWING}


def dew_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The same clean environment, with this checkout's `src` first on the path, so the Dew measured
    is the one beside the script."""
    environ = peer_environment(environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), environ.get("PYTHONPATH")]))
    return environ


@dataclasses.dataclass(frozen=True)
class Side:
    """One process to time: `role` is "dew", "peer" (ranked; the best is the ratio's denominator)
    or "reference" (timed in the same rounds, e.g. a floor, but not a peer). `config` is the JSON
    the worker receives; `env` its whole environment."""

    name: str
    role: str
    argv: tuple[str, ...]
    config: dict
    env: dict[str, str]

    def __post_init__(self):
        if self.role not in ("dew", "peer", "reference"):
            raise ValueError(f"Side {self.name!r}: role must be 'dew', 'peer' or 'reference', got {self.role!r}")


def side(name: str, role: str, script: str, script_args: Sequence[str], config: dict, *,
         python: str | None = None, env: dict[str, str] | None = None) -> Side:
    """A worker of `script` (run as `python script *script_args --worker CONFIG`); a Dew side gets
    `dew_environment()`, any other `peer_environment()` unless `env` is given."""
    if env is None:
        env = dew_environment() if role == "dew" else peer_environment()
    argv = (python or sys.executable, script, *script_args)
    return Side(name, role, argv, dict(config), env)


def thread_counts(available: int | None = None) -> list[int]:
    """Thread counts to try beside the library's default (which uses every core): 1, 2, 4, ...
    below `available`."""
    available = cores() if available is None else available
    counts, n = [], 1
    while n < available:
        counts.append(n)
        n *= 2
    return counts


def torch_sides(script: str, script_args: Sequence[str], config: dict, *, compile: bool,
                python: str | None = None, label: str = "torch") -> list[Side]:
    """The torch peer's configurations: library defaults, each count of `thread_counts()`, and
    `torch.compile` at the defaults when `compile`; exactly one has ``"loss_run": True``."""
    sides = [side(f"{label} defaults", "peer", script, script_args, {**config, "threads": None}, python=python)]
    for n in thread_counts():
        sides.append(side(f"{label} {n} thread{'s' * (n > 1)}", "peer", script, script_args,
                          {**config, "threads": n}, python=python))
    if compile:
        compiled = "torch.compile" if label == "torch" else f"{label} + torch.compile"
        sides.append(side(f"{compiled} defaults", "peer", script, script_args,
                          {**config, "threads": None, "compile": True}, python=python))
    # one configuration also runs the script's loss check (the same arithmetic in every one): one
    # thread where there is such a configuration, as it never collapses on a busy machine
    checker = next((i for i, s in enumerate(sides) if s.config["threads"] == 1), 0)
    sides[checker] = dataclasses.replace(sides[checker], config={**sides[checker].config, "loss_run": True})
    return sides


# --- the worker's end ---------------------------------------------------------------------------


class Runner:
    """What a worker runs: `info` is reported when ready, `window()` runs one timed window and
    returns (seconds, units of work), `finish()` returns what else it measured."""

    info: dict = {}

    def window(self) -> tuple[float, float]:
        raise NotImplementedError

    def finish(self) -> dict:
        return {}


def serve(config: dict, setup: Callable[[dict], Runner]) -> None:
    """The worker's loop: set up, say ready (or why it cannot run), then answer "window" and
    "finish" requests on stdin with one JSON line each on the real stdout."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything else printed goes to the log

    def say(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")

    try:
        runner = setup(config)
    except Exception as error:  # the configuration cannot run here: say why, then stop
        import traceback

        traceback.print_exc()
        say({"unavailable": f"{type(error).__name__}: {error}"[:2000]})
        return
    say({"ready": runner.info})
    for line in sys.stdin:
        request = json.loads(line)
        if request == "window":
            seconds, units = runner.window()
            say({"seconds": seconds, "units": units})
        elif request == "finish":
            say({"finished": runner.finish()})
            return
        else:
            raise ValueError(f"worker: unknown request {request!r}; expected 'window' or 'finish'")


def worker_config(argv: Sequence[str] | None = None) -> dict | None:
    """The --worker CONFIG of a script's command line, or None when it runs as the parent."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" not in argv:
        return None
    return json.loads(argv[argv.index("--worker") + 1])


# --- the parent's end ---------------------------------------------------------------------------


class Worker:
    """A running side: its process, its log and the replies read so far."""

    def __init__(self, spec: Side, workdir: Path):
        self.spec = spec
        safe = "".join(c if c.isalnum() else "_" for c in spec.name)
        self.log_path = workdir / f"{safe}.log"
        self.log = open(self.log_path, "w")
        argv = [*spec.argv, "--worker", json.dumps({**spec.config, "workdir": str(workdir)})]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, env=spec.env, text=True, bufsize=1)

    def ask(self, request: str | None) -> dict:
        if request is not None:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"{self.spec.name} exited ({self.process.returncode}): {self.log_tail()}")
        return json.loads(line)

    def log_tail(self, chars: int = 1500) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:].strip()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@dataclasses.dataclass
class Outcome:
    """One side's result: its median rate and every window's, what it said when ready and when
    finished, or why it could not run."""

    name: str
    role: str
    config: dict
    rates: list[float] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)
    finished: dict = dataclasses.field(default_factory=dict)
    unavailable: str | None = None

    @property
    def rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None


@dataclasses.dataclass
class Comparison:
    outcomes: list[Outcome]
    order: list[str]  # the sides' names in the order their windows ran
    load_average: tuple[float, float]  # 1-minute load average before and after

    def by_role(self, role: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.role == role]

    @property
    def dew(self) -> Outcome:
        return self.by_role("dew")[0]

    @property
    def best_peer(self) -> Outcome:
        ran = [o for o in self.by_role("peer") if o.rate is not None]
        if not ran:
            reasons = "; ".join(f"{o.name}: {o.unavailable}" for o in self.by_role("peer"))
            raise RuntimeError(f"no peer configuration ran: {reasons}")
        return max(ran, key=lambda o: o.rate)

    @property
    def ratio(self) -> float:
        return self.dew.rate / self.best_peer.rate

    def peers_report(self, digits: int = 2) -> dict:
        """Every peer configuration's median rate, or why it did not run."""
        return {o.name: round(o.rate, digits) if o.rate is not None else f"unavailable: {o.unavailable}"
                for o in self.by_role("peer")}

    def report(self, unit: str, digits: int = 2) -> dict:
        """The figures every benchmark prints: Dew's rate, each peer configuration's, the best and
        Dew's ratio against it, the references, how it was timed and the load."""
        best = self.best_peer
        return {
            f"dew_{unit}": round(self.dew.rate, digits),
            f"peer_{unit}_by_config": self.peers_report(digits),
            "best_peer": best.name,
            f"best_peer_{unit}": round(best.rate, digits),
            "dew_over_best_peer": round(self.ratio, 3),
            **{f"{o.name}_{unit}": round(o.rate, digits) for o in self.by_role("reference") if o.rate},
            "windows_per_side": len(self.dew.rates),
            "timing": "each side in its own process at its library defaults (peers' environments "
                      f"free of {', '.join(SLOWING[:3])}, ...); median of alternating windows, setup and "
                      "compile excluded",
            "load_average_1m": [round(x, 2) for x in self.load_average],
        }


def compare(sides: Sequence[Side], repeats: int, *, workdir: str | Path | None = None,
            progress: Callable[[str], None] | None = None) -> Comparison:
    """Start every side (one at a time), run `repeats` rounds of one window each, rotating the order
    each round, then collect each side's finishing report. Exactly one side has role "dew"."""
    if sum(s.role == "dew" for s in sides) != 1:
        raise ValueError(f"compare: expected exactly one Dew side, got roles {[s.role for s in sides]}")
    if repeats < 1:
        raise ValueError(f"compare: repeats must be at least 1, got {repeats}")
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="dew-bench-"))
        workdir = Path(workdir)
        outcomes = {s.name: Outcome(s.name, s.role, {k: v for k, v in s.config.items() if k != "workdir"})
                    for s in sides}
        live: list[Worker] = []
        try:
            for spec in sides:
                start = time.perf_counter()
                worker = Worker(spec, workdir)
                try:
                    reply = worker.ask(None)
                except RuntimeError as error:
                    reply = {"unavailable": str(error)}
                if "unavailable" in reply:
                    outcomes[spec.name].unavailable = reply["unavailable"]
                    say(f"{spec.name}: unavailable ({reply['unavailable'][:200]})")
                    worker.close()
                    continue
                outcomes[spec.name].info = reply["ready"]
                say(f"{spec.name}: ready in {time.perf_counter() - start:.1f} s")
                live.append(worker)
            order = []
            for round_ in range(repeats):
                shift = round_ % len(live)
                for worker in live[shift:] + live[:shift]:
                    reply = worker.ask("window")
                    outcomes[worker.spec.name].rates.append(reply["units"] / reply["seconds"])
                    order.append(worker.spec.name)
                say(f"round {round_ + 1}/{repeats}: " + ", ".join(
                    f"{w.spec.name} {outcomes[w.spec.name].rates[-1]:.4g}" for w in live))
            for worker in live:
                outcomes[worker.spec.name].finished = worker.ask("finish")["finished"]
        finally:
            for worker in live:
                worker.close()
    if outcomes[next(s.name for s in sides if s.role == "dew")].rate is None:
        dew = outcomes[next(s.name for s in sides if s.role == "dew")]
        raise RuntimeError(f"the Dew side did not run: {dew.unavailable}")
    return Comparison(list(outcomes.values()), order, (load_before, os.getloadavg()[0]))
