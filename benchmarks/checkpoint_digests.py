"""The cost of checkpoint digests: step time with checkpoints every 10 steps, with and without them.

The work is `lm_train.py`'s nanoGPT-sized decoder (4 layers, 4 heads, width 128, SwiGLU 512, context
64, batch 12, AdamW) trained by Dew's `Trainer`. Three ways to run it take turns in timed windows of
--window steps, in one process, so machine noise falls on all three alike:
  - `none`: no checkpoints;
  - `without_digests`: a checkpoint every --every steps written as Dew wrote them before digests
    (Orbax copies the arrays off the device itself; `state` and `data` items only);
  - `unhashed`: `Checkpoints` as it is, with the hashing alone skipped (the same host copy, Orbax
    writes and `digests` item, each array's digest replaced by a constant);
  - `with_digests`: a checkpoint every --every steps with `Checkpoints` as it is (one host copy,
    handed to Orbax and checksummed with CRC-32 on Orbax's background thread, a `digests` item).
Each window trains from a fresh state into an empty directory and includes the wait for its last
write. Each window's wall time and process CPU time (all threads: XLA's, Orbax's writers, the
hashing) are taken. The cost of checksumming is, per round of windows, (with_digests - unhashed)
/ none, and the change against the save path before digests (with_digests - without_digests) /
none; each figure is the median over --repeats rounds. The
machine is shared and noisy (single windows move by tens of percent), so the paired medians are
what to read, and the CPU-time figure is the steadier of the two. Also reported: the state's size
and the time to hash it once on the calling thread. Prints one JSON line.

    .venv/bin/python benchmarks/checkpoint_digests.py [--window 50] [--every 10] [--repeats 15]
        [--data ../shared/data/tinyshakespeare.txt | --synthetic]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from dew import Checkpoints, Dataset
from dew.training import digests, positions
from dew.training.checkpoints import POSITION_ENCODING, _to_storable
from common import cores
from lm_train import BATCH, DEFAULT_DATA, dew_trainer, load_corpus, make_batches

GOAL = 0.02  # digests may cost at most this share of the training time


class WithoutDigests(Checkpoints):
    """Checkpoints written as before digests: Orbax copies the arrays itself; no digests item."""

    def save(self, state, data_position=None):
        import orbax.checkpoint as ocp

        self.wait()
        data = {"encoding": POSITION_ENCODING, "position": positions.encode(data_position)}
        self.manager.save(
            int(state.step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(_to_storable(state)), data=ocp.args.JsonSave(data)),
        )


@contextlib.contextmanager
def hashing_skipped():
    """Every array digest is a constant while inside (the background writes look it up per call)."""
    original = digests.array_digest
    digests.array_digest = lambda array: "crc32:skipped"
    try:
        yield
    finally:
        digests.array_digest = original


def grain_batches(batches) -> Dataset:
    """The batches in turn, forever, from a Grain iterator (checkpoints need its position)."""
    import grain

    rows = grain.MapDataset.source([{"text": b} for b in batches]).repeat()
    return Dataset(train=lambda partition: iter(rows.to_iter_dataset()), records=len(batches), batch=BATCH)


def timed_window(trainer, data, steps: int, checkpoints: Checkpoints | None, every: int | None, hashing=True):
    """Wall and process CPU seconds to train `steps` steps from a fresh state, writing checkpoints
    if given (fit returns once its last write is on disk)."""
    trainer.checkpoints = checkpoints
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(sys.stderr), (contextlib.nullcontext() if hashing else hashing_skipped()):
        state = trainer.fit(data, steps=steps, log_every=steps, checkpoint_every=every)
    jax.block_until_ready(state)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if checkpoints is not None:
        checkpoints.close()
    return wall, cpu


def paired_share(seconds: dict[str, list[float]], over: str, under: str) -> float:
    """Median over rounds of (over - under) / none: what `over` adds, as a share of training time."""
    rounds = zip(seconds[over], seconds[under], seconds["none"])
    return statistics.median((a - b) / base for a, b, base in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--data", default=DEFAULT_DATA)
    parser.add_argument("--synthetic", action="store_true")
    args = parser.parse_args()

    corpus, corpus_name = load_corpus(args.data, args.synthetic)
    data = grain_batches(make_batches(corpus, 200))
    scratch = Path(tempfile.mkdtemp(prefix="dew-digests-"))
    modes = {
        "none": lambda directory: (None, None),
        "without_digests": lambda directory: (WithoutDigests(directory, keep=2), args.every),
        "unhashed": lambda directory: (Checkpoints(directory, keep=2), args.every, False),
        "with_digests": lambda directory: (Checkpoints(directory, keep=2), args.every),
    }
    trainers = {name: dew_trainer() for name in modes}
    wall: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for name, make in modes.items():  # compile, and write once, outside the timed windows
            timed_window(trainers[name], data, args.every, *make(scratch / f"warm-{name}"))
        for repeat in range(args.repeats):
            turn = repeat % len(modes)
            for name in list(modes)[turn:] + list(modes)[:turn]:  # each mode goes first in turn
                window_wall, window_cpu = timed_window(
                    trainers[name], data, args.window, *modes[name](scratch / f"{name}-{repeat}"))
                wall[name].append(window_wall)
                cpu[name].append(window_cpu)
        state = trainers["none"].init_state()
        host = jax.device_get(_to_storable(state))
        arrays = digests.named_arrays(host)
        state_bytes = sum(np.asarray(a).nbytes for _, a in arrays)
        hashing = []
        for _ in range(5):
            start = time.perf_counter()
            for _, array in arrays:
                digests.array_digest(array)
            hashing.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def per_step_ms(seconds):
        return {name: round(1000 * statistics.median(s) / args.window, 3) for name, s in seconds.items()}

    def shares(over, under):
        return {"wall": round(paired_share(wall, over, under), 4), "cpu": round(paired_share(cpu, over, under), 4)}

    hashing_share = shares("with_digests", "unhashed")
    print(json.dumps({
        "benchmark": "checkpoint_digests",
        "work": f"lm_train decoder, batch {BATCH}, {corpus_name}; a checkpoint every {args.every} steps (keep=2)",
        "wall_ms_per_step_median": per_step_ms(wall),
        "cpu_ms_per_step_median": per_step_ms(cpu),
        "hashing_share_of_training_time": hashing_share,
        "with_digests_against_the_save_before_digests": shares("with_digests", "without_digests"),
        "checkpointing_share_with_digests": shares("with_digests", "none"),
        "checkpointing_share_before_digests": shares("without_digests", "none"),
        "goal": f"hashing share of wall time < {GOAL:.0%}",
        "met": hashing_share["wall"] < GOAL,
        "state_mb": round(state_bytes / 1e6, 2),
        "hash_ms_per_save_on_one_thread": round(1000 * statistics.median(hashing), 2),
        "windows": f"{args.repeats} rounds of {args.window} steps per mode, interleaved; paired medians",
        "window_wall_seconds": {name: [round(x, 3) for x in s] for name, s in wall.items()},
        "hardware": f"{platform.processor() or platform.machine()}, {cores()} cores, jax {jax.__version__} "
                    f"{jax.default_backend()}",
    }))


if __name__ == "__main__":
    main()
