"""Progress reporting: a live bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def format_scalars(scalars: Mapping[str, float]) -> str:
    return " ".join(f"{name} {value:.4g}" for name, value in scalars.items())


class ProgressReport:
    """Steps per second and ETA over the steps run in this process; renders to a TTY or lines."""

    def __init__(self, start: int, target: int, *, stream=None, live: bool | None = None):
        self.start, self.target = start, target
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        # The clock starts at the first finished step, so compilation does not count as a step.
        self._began: float | None = None
        self._first = start
        self._bar = None
        if self.live and target > start:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[rate]:.2f} steps/s"),
                TextColumn("{task.fields[scalars]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task(
                "train", total=target, completed=start, rate=0.0, scalars=""
            )
            self._bar.start()

    def rate(self, step: int) -> float:
        if self._began is None:
            return 0.0
        elapsed = time.perf_counter() - self._began
        return (step - self._first) / elapsed if elapsed > 0 and step > self._first else 0.0

    def eta(self, step: int) -> float:
        rate = self.rate(step)
        return (self.target - step) / rate if rate > 0 else float("inf")

    def advance(self, step: int) -> None:
        """Note that `step` has finished (its metrics reached the host)."""
        if self._began is None and step > self.start:
            self._began, self._first = time.perf_counter(), step
        if self._bar is not None:
            self._bar.update(self._task, completed=step, rate=self.rate(step))

    def report(self, step: int, scalars: Mapping[str, float]) -> None:
        """A logging step: update the bar's scalars, or print one line."""
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, rate=self.rate(step), scalars=format_scalars(scalars)
            )
            return
        eta = self.eta(step)
        eta_text = format_seconds(eta) if eta != float("inf") else "?"
        print(
            f"step {step}/{self.target} {format_scalars(scalars)} "
            f"| {self.rate(step):.2f} steps/s | eta {eta_text}",
            file=self.stream,
            flush=True,
        )

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
