"""`dew checkpoints verify DIR`: check every checkpoint step of a run against its digests."""

from __future__ import annotations

from typing import Annotated, Literal

import tyro
from tyro.conf import Positional


def run(
    action: Positional[Literal["verify"]],
    directory: Positional[Annotated[str, tyro.conf.arg(metavar="DIR")]],
    step: int | None = None,
) -> int:
    """Check checkpoint steps against the digests recorded when they were saved.

    Prints one line per step (intact, or what is damaged: the item, the array, the expected and the
    found digest) and exits with status 1 when any step is damaged.

    Args:
        action: What to do; "verify" reads every array of each step and compares its digest.
        directory: The checkpoint directory (a run directory holding numbered steps).
        step: Check only this step (default: every step).
    """
    from dew.training.checkpoints import Checkpoints

    checkpoints = Checkpoints(directory)
    report = checkpoints.verify(step)
    if not report:
        raise SystemExit(f"{checkpoints.directory} holds no complete checkpoint step.")
    for checked, damage in report.items():
        if damage is not None:
            print(f"step {checked}: DAMAGED: {damage}")
        elif checkpoints.digested(checked):
            print(f"step {checked}: intact")
        else:
            print(f"step {checked}: readable (written without digests, so not checked)")
    damaged = [s for s, damage in report.items() if damage is not None]
    intact = [s for s, damage in report.items() if damage is None]
    if damaged:
        newest = f"the newest intact step is {intact[-1]}" if intact else "no step checked is intact"
        print(f"{len(damaged)} of {len(report)} steps damaged; {newest}.")
        raise SystemExit(1)
    print(f"{len(report)} of {len(report)} steps intact.")
    return 0
