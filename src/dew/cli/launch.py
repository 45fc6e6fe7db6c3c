"""`dew launch`: start one process per device group of a run, on this machine or on several.

    dew launch [--hosts a,b] [--processes-per-host n] [--env K=V ...] [--tpu NAME --zone Z]
               [--port P] [--dry-run] -- python script.py ...

Where it runs:
- no --hosts, --tpu or Slurm allocation: on this machine, one process per GPU (or
  --processes-per-host of them), the coordinator on 127.0.0.1;
- --hosts: the same command over ssh on each host, the coordinator on the first host;
- inside a Slurm allocation (SLURM_JOB_ID set): one `srun` over the allocation's nodes;
- --tpu NAME --zone Z: `gcloud compute tpus tpu-vm ssh --worker=all` on every worker of a Cloud TPU.
Each process gets the pool's coordinator, size and its rank (variables that
`dew.training.runtime.prepare_process` reads; Slurm and TPU processes are found by JAX itself).
The launcher prefixes every output line with its rank, and when one process fails it stops all
the others and exits with that process's status. --dry-run prints the exact commands instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from dew.training.runtime import COORDINATOR, LOCAL_DEVICE_IDS, NUM_PROCESSES, PROCESS_ID

DEFAULT_PORT = 8476  # the coordinator's port on the first of several hosts
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Process:
    """One command the launcher starts: its label (a rank, or "all" for srun/gcloud, which start
    the ranks themselves), the argv, and the variables added to this machine's environment."""

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def shell(self) -> str:
        """The command as one shell line, with its added variables in front."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join([*assignments, shlex.join(self.argv)])


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """`K=V` strings as a dict, each name checked."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not ENV_NAME.fullmatch(name):
            raise ValueError(f"--env takes NAME=VALUE with NAME a variable name; got {pair!r}.")
        env[name] = value
    return env


def local_gpus(environ: Mapping[str, str]) -> list[int]:
    """This machine's NVIDIA GPU ids (CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(d) for d in visible.split(",") if d.strip().isdigit()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return list(range(sum(line.startswith("GPU ") for line in listing.splitlines())))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def plan(
    command: Sequence[str],
    *,
    hosts: Sequence[str] = (),
    processes_per_host: int | None = None,
    env: Mapping[str, str] | None = None,
    tpu: str | None = None,
    zone: str | None = None,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Process]:
    """The processes `dew launch` starts for `command` (see the module docstring)."""
    from dew.checks import count

    environ = os.environ if environ is None else environ
    env = dict(env or {})
    if not command:
        raise ValueError("dew launch needs the command to run after --, e.g. dew launch -- python train.py")
    processes_per_host = count(processes_per_host, "processes_per_host", optional=True)
    if tpu is not None:
        if hosts:
            raise ValueError("Pass either --tpu (every worker of a Cloud TPU) or --hosts, not both.")
        if not zone:
            raise ValueError(f"--tpu {tpu} needs --zone, the TPU's zone (e.g. us-central2-b).")
        remote = Process("all", tuple(command), env).shell()
        argv = ("gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}", "--worker=all", f"--command={remote}")
        return [Process("all", argv)]
    gpus = local_gpus(environ)
    per_host = processes_per_host or max(len(gpus), 1)
    if not hosts and environ.get("SLURM_JOB_ID"):
        argv = ("srun", "--label", "--kill-on-bad-exit=1", f"--ntasks-per-node={per_host}", "env",
                *(f"{k}={v}" for k, v in env.items()), *command)
        return [Process("all", argv)]
    if gpus and len(gpus) % per_host:
        raise ValueError(f"{len(gpus)} GPUs do not split over {per_host} processes per host; pick a divisor of {len(gpus)}.")
    share = len(gpus) // per_host
    groups = [gpus[i * share:(i + 1) * share] for i in range(per_host)] if gpus else [None] * per_host
    hosts = [h.strip() for h in hosts if h.strip()]
    coordinator = f"{hosts[0]}:{port or DEFAULT_PORT}" if hosts else f"127.0.0.1:{port or free_port()}"
    total = per_host * max(len(hosts), 1)
    processes = []
    for rank in range(total):
        variables = {COORDINATOR: coordinator, NUM_PROCESSES: str(total), PROCESS_ID: str(rank)}
        group = groups[rank % per_host]
        if group is not None:
            variables[LOCAL_DEVICE_IDS] = ",".join(map(str, group))
        variables.update(env)
        if hosts:
            host = hosts[rank // per_host]
            remote = Process(str(rank), tuple(command), variables).shell()
            argv = ("ssh", "-tt", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, remote)
            processes.append(Process(str(rank), argv))
        else:
            processes.append(Process(str(rank), tuple(command), variables))
    return processes


def run(processes: Sequence[Process], *, out=None, grace_s: float = 10.0) -> int:
    """Start `processes`, print their output prefixed by label, and stop them all when one fails.

    Returns 0 when every process exits 0, else the first failure's status (128 + signal for a
    process killed by a signal)."""
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    started: list[tuple[Process, subprocess.Popen]] = []

    def relay(label: str, stream) -> None:
        for line in iter(stream.readline, ""):
            with lock:
                out.write(f"[{label}] {line.rstrip(chr(13) + chr(10))}\n")
                out.flush()

    readers = []
    try:
        for process in processes:
            child = subprocess.Popen(
                process.argv, env={**os.environ, **process.env}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
            )
            started.append((process, child))
            reader = threading.Thread(target=relay, args=(process.label, child.stdout), daemon=True)
            reader.start()
            readers.append(reader)
        status = 0
        while status == 0 and any(child.poll() is None for _, child in started):
            for process, child in started:
                code = child.poll()
                if code not in (None, 0):
                    status = 128 - code if code < 0 else code
                    with lock:
                        out.write(f"dew launch: process {process.label} exited with status {status}; stopping the others\n")
                        out.flush()
                    break
            else:
                time.sleep(0.1)
        if status == 0:
            codes = [child.wait() for _, child in started]
            failed = [c for c in codes if c != 0]
            status = (128 - failed[0] if failed[0] < 0 else failed[0]) if failed else 0
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(started, grace_s)
        for reader in readers:
            reader.join(timeout=5)
    return status


def _stop(started: Sequence[tuple[Process, subprocess.Popen]], grace_s: float) -> None:
    """SIGTERM every process group still running, then SIGKILL what outlives `grace_s`."""
    running = [child for _, child in started if child.poll() is None]
    for child in running:
        _signal(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal(child, signal.SIGKILL)
            child.wait()


def _signal(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:
        pass


def main(argv: Sequence[str]) -> int:
    """`dew launch ...`: parse, plan, then run (or print with --dry-run)."""
    parser = argparse.ArgumentParser(prog="dew launch", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--hosts", default="", help="comma-separated hosts reached over ssh (default: this machine)")
    parser.add_argument("--processes-per-host", type=int, help="processes on each host (default: one per GPU, else 1)")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="a variable for every process (repeatable)")
    parser.add_argument("--tpu", help="a Cloud TPU's name: run on all of its workers through gcloud")
    parser.add_argument("--zone", help="the Cloud TPU's zone")
    parser.add_argument("--port", type=int, help=f"the coordinator's port (default: free on this machine; {DEFAULT_PORT} with --hosts)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    args = parser.parse_args(list(argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    processes = plan(command, hosts=args.hosts.split(",") if args.hosts else (), processes_per_host=args.processes_per_host,
                     env=parse_env(args.env), tpu=args.tpu, zone=args.zone, port=args.port)
    if args.dry_run:
        for process in processes:
            print(f"[{process.label}] {process.shell()}")
        return 0
    return run(processes)
