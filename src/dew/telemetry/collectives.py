"""The collectives one run of a compiled program performs, read from its HLO text.

XLA's optimized HLO names each cross-device operation (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute). An operation inside a while loop's body runs once per
iteration, so each computation's operations are counted as many times as its callers run it:
a scanned layer stack's collectives count once per layer. Bytes are the operation's result on one
device (what it gathers, reduces or receives), not the traffic on the wire, which depends on the
algorithm and topology the runtime picks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of HLO's element types (tokens and opaque values carry no data).
ELEMENT_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:[a-z]\w*)?)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective: how many times a step runs it and the bytes of its results."""

    kind: str
    count: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Every collective kind a program runs (kinds it never runs have count 0).

    `unknown_trip_counts` counts while loops whose iteration count XLA did not record; their
    bodies are counted once, so the totals are a lower bound when it is above zero.
    """

    kinds: tuple[Collective, ...]
    unknown_trip_counts: int = 0

    def __getitem__(self, kind: str) -> Collective:
        for collective in self.kinds:
            if collective.kind == kind:
                return collective
        raise KeyError(f"{kind!r} is not a collective kind; kinds are {KINDS}")

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.kinds)


def array_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape (`f32[8,32]{1,0}` or a tuple of them)."""
    total = 0
    for element, dims in _ARRAY.findall(shape_text):
        if element not in ELEMENT_BYTES:
            continue
        sizes = [int(d) for d in dims.split(",") if d]
        total += ELEMENT_BYTES[element] * math.prod(sizes)
    return total


def _result_bytes(kind: str, shape_text: str) -> int:
    """The bytes an operation produces; an async `-start` of a gather or permute returns its input
    beside its output, so only the largest array counts there."""
    if not kind.endswith("-start") or kind == "all-reduce-start":
        return array_bytes(shape_text)
    return max((array_bytes(f"{e}[{d}]") for e, d in _ARRAY.findall(shape_text)), default=0)


def count_collectives(hlo_text: str) -> Collectives:
    """Count the collectives of an optimized HLO module (`compiled.as_text()`), per execution."""
    found: dict[str, list[tuple[str, int]]] = defaultdict(list)  # computation -> (kind, bytes)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)  # caller -> (callee, times)
    entry, current, unknown = None, None, 0
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        instruction = _INSTRUCTION.match(line)
        if current is None or instruction is None:
            continue
        shape_text, opcode = instruction.groups()
        kind = opcode.removesuffix("-start")
        if kind in KINDS and not opcode.endswith("-done"):
            found[current].append((kind, _result_bytes(opcode, shape_text)))
        body = _BODY.search(line) if opcode == "while" else None
        trips = _TRIP_COUNT.search(line)
        if body and not trips:
            unknown += 1
        for callee in _CALLEES.findall(line):
            times = int(trips.group(1)) if body and trips and callee == body.group(1) else 1
            calls[current].append((callee, times))
        for branches in _BRANCHES.findall(line):
            for callee in branches.split(","):
                calls[current].append((callee.strip().lstrip("%"), 1))
    if entry is None:
        raise ValueError("count_collectives needs an HLO module's text with an ENTRY computation "
                         "(compiled.as_text()); none was found")

    runs: dict[str, int] = defaultdict(int)

    def visit(computation: str, times: int) -> None:
        runs[computation] += times
        for callee, per_call in calls.get(computation, ()):
            visit(callee, times * per_call)

    visit(entry, 1)
    counts = {kind: [0, 0] for kind in KINDS}
    for computation, operations in found.items():
        for kind, size in operations:
            counts[kind][0] += runs[computation]
            counts[kind][1] += runs[computation] * size
    return Collectives(
        kinds=tuple(Collective(kind, count, size) for kind, (count, size) in counts.items()),
        unknown_trip_counts=unknown,
    )
