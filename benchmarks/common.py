"""Pieces the benchmarks against a torch peer share (the scripts import it from their own folder)."""

from __future__ import annotations

import itertools
import os
import time


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class EagerLoop:
    """A peer's eager training loop: subclasses set ``self.batches`` and define ``step(batch)``,
    which returns the step's loss as a tensor (read only after the timed loop, so no sync inside)."""

    batches: list

    def step(self, batch):
        raise NotImplementedError

    def run(self, steps: int) -> tuple[float, list[float]]:
        """Seconds for `steps` steps over the batches in turn, and each step's loss."""
        start = time.perf_counter()
        losses = [self.step(b) for b in itertools.islice(itertools.cycle(self.batches), steps)]
        seconds = time.perf_counter() - start
        return seconds, [float(x) for x in losses]
