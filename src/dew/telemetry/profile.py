"""Profiler captures over `jax.profiler`: one new directory per capture, with its manifest.

A capture keeps the native XPlane trace (and the Chrome trace JAX writes beside it), the HLO that
exists for it (the StableHLO of programs compiled during the capture, the HloProtos GPU and TPU
traces carry, and texts a caller adds), XProf's reports when XProf is installed (the `profile` extra), and `manifest.json`:
backend, package versions, capture options, which reports are available (and why the others are
not), device counters (a counter the backend lacks is recorded as missing, never as zero) and
the command that opens the capture. JAX's Python tracer is off unless `options` turns it on: it
records every Python call and slows host work several times over.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew.checks import count_fields
from dew.files import write_atomic

# XProf's reports written into a capture when XProf is installed, by its tool names.
XPROF_REPORTS = (
    "overview_page",
    "input_pipeline_analyzer",
    "kernel_stats",
    "memory_profile",
    "framework_op_stats",
    "hlo_stats",
    "op_profile",
    "roofline_model",
)

_active: Profiler | None = None  # JAX allows one trace per process


def capture_options(**settings: Any):
    """Dew's `jax.profiler.ProfileOptions`: the Python tracer off, host tracing at level 2, HLO
    protos on; `settings` (the options' own attribute names) override any of them.

    `jax.profiler.start_trace(directory, profiler_options=capture_options())` traces with the
    settings a `Profiler` uses."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 2
    options.enable_hlo_proto = True
    known = _option_names(options)
    for name, value in settings.items():
        if name not in known:
            raise ValueError(
                f"{name!r} is not a jax.profiler.ProfileOptions setting; the settings are {sorted(known)}."
            )
        setattr(options, name, value)
    return options


@dataclasses.dataclass(frozen=True)
class ProfileWindow:
    """Trace `steps` training steps after `warmup` steps of a fit (counted from the step the fit
    starts at), into a new capture under `directory`: `Trainer(..., profile=ProfileWindow(...))`.
    The warm-up keeps compilation and the first dispatches out of the trace."""

    directory: str | os.PathLike
    steps: int = 3
    warmup: int = 2
    options: Any = None

    def __post_init__(self):
        count_fields(self, steps=1, warmup=0)

    def first_step(self, start: int) -> int:
        """The first traced step of a fit that resumes from step `start`."""
        return start + self.warmup + 1

    def last_step(self, start: int) -> int:
        return start + self.warmup + self.steps

    def check_fits(self, start: int, target: int) -> None:
        """Fail before training when the window ends past the fit's target step."""
        if self.last_step(start) > target:
            raise ValueError(
                f"ProfileWindow(steps={self.steps}, warmup={self.warmup}) traces steps "
                f"{self.first_step(start)}..{self.last_step(start)}, but this fit runs steps "
                f"{start + 1}..{target}. Lower warmup or steps, or fit to at least step "
                f"{self.last_step(start)}."
            )


def running_capture() -> Profiler | None:
    """The Profiler whose capture is running in this process, if any."""
    return _active


class Profiler:
    """Capture a JAX profile of whatever runs between `start()` and `stop()` (or inside `with`).

    Each capture is a new `capture-<id>` directory under `directory`, so earlier captures are
    kept. Without a directory the first start makes a temporary one (not deleted), available as
    `profiler.directory`. `options` is a `jax.profiler.ProfileOptions` or a mapping of its
    settings (see `capture_options`). `stop()` returns the capture directory; `captures` lists
    every capture so far and `manifest` is the latest one's manifest.
    """

    def __init__(self, directory: str | os.PathLike | None = None, options: Any = None):
        self.directory = None if directory is None else Path(directory)
        if options is None:
            options = capture_options()
        elif isinstance(options, Mapping):
            options = capture_options(**options)
        elif not hasattr(options, "python_tracer_level"):
            raise TypeError(
                "Profiler options must be a jax.profiler.ProfileOptions or a mapping of its settings "
                f"(e.g. {{'python_tracer_level': 1}}); got {type(options).__name__}."
            )
        self.options = options
        self.captures: list[Path] = []
        self.manifest: dict[str, Any] | None = None
        self._capture: Path | None = None
        self._started = 0.0
        self._hlo: dict[str, str] = {}
        self._dumping = False

    @property
    def active(self) -> bool:
        return self._capture is not None

    def start(self) -> Path:
        """Start tracing into a new capture directory, which is returned."""
        global _active
        import jax

        if _active is not None:
            raise RuntimeError(
                f"A profiler capture is already running (into {_active._capture}); JAX traces one "
                "capture at a time. Stop it first, and use either an outer dew.Profiler or a "
                "Trainer ProfileWindow, not both."
            )
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="dew-profile-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        capture = _new_capture_directory(self.directory)
        jax.profiler.start_trace(str(capture), profiler_options=self.options)
        # Programs compiled during the capture leave their StableHLO in it (unless the user
        # already sends JAX's IR dumps elsewhere).
        self._dumping = not jax.config.values["jax_dump_ir_to"]
        if self._dumping:
            jax.config.update("jax_dump_ir_to", str(capture / "hlo" / "stablehlo"))
        self._capture, self._started, self._hlo = capture, time.time(), {}
        _active = self
        return capture

    def add_hlo(self, name: str, text: str) -> None:
        """Keep one program's HLO text in the running capture (as `hlo/<name>.txt`)."""
        if self._capture is None:
            raise RuntimeError("add_hlo needs a running capture: call start() first.")
        self._hlo[name] = text

    def stop(self, **details: Any) -> Path:
        """Stop tracing, write the HLO, reports and manifest, and return the capture directory.
        `details` (JSON-ready) are added to the manifest, e.g. the steps a window traced."""
        global _active
        import jax

        if self._capture is None:
            raise RuntimeError("Profiler.stop() without a running capture: call start() first.")
        capture, self._capture, _active = self._capture, None, None
        try:
            jax.block_until_ready(jax.live_arrays())  # the traced work finishes inside the trace
        finally:
            jax.profiler.stop_trace()
            if self._dumping:
                jax.config.update("jax_dump_ir_to", "")
        stopped = time.time()
        traces = sorted(capture.glob("plugins/profile/*/*.xplane.pb"))
        hlo = _write_hlo(capture, traces, self._hlo)
        reports = _write_reports(capture, traces)
        manifest = {
            "capture": str(capture),
            "started": _iso(self._started),
            "seconds": round(stopped - self._started, 6),
            "backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.local_devices()],
            "process": {"index": jax.process_index(), "count": jax.process_count()},
            "versions": _versions(),
            "options": {name: _jsonable(getattr(self.options, name)) for name in sorted(_option_names(self.options))},
            "traces": [str(p.relative_to(capture)) for p in traces],
            "hlo": hlo,
            "reports": reports,
            "counters": _counters(),
            "view_command": f"xprof --logdir={capture}",
            **details,
        }
        write_atomic(capture / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        self.captures.append(capture)
        self.manifest = manifest
        return capture

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._capture is not None:
            self.stop()


def _new_capture_directory(root: Path) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for index in range(10_000):
        candidate = root / f"capture-{stamp}-{index}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"No free capture directory name under {root}.")  # pragma: no cover


def _option_names(options: Any) -> set[str]:
    return {
        name
        for name in dir(options)
        if not name.startswith("_") and not callable(getattr(options, name)) and name != "advanced_configuration"
    }


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("dewml", "jax", "jaxlib", "flax", "optax", "xprof"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _counters() -> dict[str, Any]:
    """Device memory counters where the backend reports them; a missing one says why."""
    import jax

    counters: dict[str, Any] = {}
    for device in jax.local_devices():
        stats = device.memory_stats()
        for name in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit"):
            key = f"{device.platform}:{device.id}/{name}"
            if stats is not None and name in stats:
                counters[key] = int(stats[name])
            else:
                counters[key] = {"missing": f"the {device.platform} backend does not report {name}"}
    return counters


def _write_hlo(capture: Path, traces: list[Path], given: Mapping[str, str]) -> list[str]:
    """Write the HLO protos the traces carry (GPU and TPU record them; XLA:CPU does not) and the
    HLO texts handed to `add_hlo`; return every HLO file of the capture (with the StableHLO of
    programs compiled during it), relative to the capture."""
    folder = capture / "hlo"
    for name, text in given.items():
        write_atomic(folder / f"{_safe(name)}.txt", text)
    for trace in traces:
        for name, proto in hlo_protos(trace.read_bytes()).items():
            write_atomic(folder / f"{_safe(name)}.hlo_proto.pb", proto)
    return sorted(str(p.relative_to(capture)) for p in folder.rglob("*") if p.is_file())


def _write_reports(capture: Path, traces: list[Path]) -> dict[str, dict[str, Any]]:
    """XProf's reports for the capture, each available (with its file) or missing (with why)."""
    reports: dict[str, dict[str, Any]] = {}
    json_traces = sorted(capture.glob("plugins/profile/*/*.trace.json.gz"))
    reports["trace_events"] = (
        {"available": True, "file": str(json_traces[0].relative_to(capture))}
        if json_traces
        else {"available": False, "reason": "JAX wrote no Chrome trace for this capture"}
    )
    if not traces:
        for tool in XPROF_REPORTS:
            reports[tool] = {"available": False, "reason": "the capture holds no XPlane trace"}
        return reports
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        for tool in XPROF_REPORTS:
            reports[tool] = {
                "available": False,
                "reason": "XProf is not installed (pip install 'dewml[profile]'); the XPlane trace "
                "holds everything it needs, so view_command works once it is",
            }
        return reports
    paths = [str(p) for p in traces]
    offered = set(raw_to_tool_data.xspace_to_tool_names(paths))
    for tool in XPROF_REPORTS:
        if tool not in offered:
            reports[tool] = {"available": False, "reason": f"XProf offers no {tool} for this backend"}
            continue
        try:
            data, _ = raw_to_tool_data.xspace_to_tool_data(paths, tool, {})
        except Exception as error:  # a report XProf fails to build is recorded, not fatal
            reports[tool] = {"available": False, "reason": f"{type(error).__name__}: {error}"}
            continue
        if data is None:
            reports[tool] = {"available": False, "reason": f"XProf produced no {tool} data"}
            continue
        path = write_atomic(capture / "reports" / f"{tool}.json", data)
        reports[tool] = {"available": True, "file": str(path.relative_to(capture))}
    return reports


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "module"


# ----------------------------------------------------------------------------------------------
# Reading an XSpace (tsl/profiler/protobuf/xplane.proto) just far enough to find its HLO protos:
# the "/host:metadata" plane keeps one event metadata per program, with an "hlo_proto" stat.


def hlo_protos(xspace: bytes) -> dict[str, bytes]:
    """The serialized HloProto of each program a serialized XSpace records, by program name."""
    found: dict[str, bytes] = {}
    for number, plane in _fields(xspace):
        if number != 1:  # XSpace.planes
            continue
        plane_fields = list(_fields(plane))
        if _string(plane_fields, 2) != "/host:metadata":
            continue
        stat_names = {}
        for field, entry in plane_fields:
            if field == 5:  # stat_metadata map entry: value is XStatMetadata
                value = dict(_fields(entry)).get(2, b"")
                stat_fields = list(_fields(value))
                stat_names[_integer(stat_fields, 1)] = _string(stat_fields, 2)
        for field, entry in plane_fields:
            if field != 4:  # event_metadata map entry: value is XEventMetadata
                continue
            metadata = list(_fields(dict(_fields(entry)).get(2, b"")))
            name = _string(metadata, 2) or f"program-{_integer(metadata, 1)}"
            for stat_field, stat in metadata:
                if stat_field != 5:
                    continue
                stat_values = list(_fields(stat))
                if stat_names.get(_integer(stat_values, 1)) == "hlo_proto":
                    proto = dict(stat_values).get(6)  # XStat.bytes_value
                    if isinstance(proto, bytes):
                        found[name] = proto
    return found


def _fields(message: bytes):
    """(field number, value) pairs of a protobuf message: ints for varints, bytes for
    length-delimited fields; fixed-width fields are skipped."""
    offset = 0
    while offset < len(message):
        key, offset = _varint(message, offset)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, offset = _varint(message, offset)
            yield number, value
        elif wire == 2:
            length, offset = _varint(message, offset)
            yield number, message[offset : offset + length]
            offset += length
        elif wire == 1:
            offset += 8
        elif wire == 5:
            offset += 4
        else:
            raise ValueError(f"Unsupported protobuf wire type {wire} in an XSpace.")


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def _string(fields, number: int) -> str:
    value = dict(fields).get(number, b"")
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else ""


def _integer(fields, number: int) -> int:
    value = dict(fields).get(number, 0)
    return value if isinstance(value, int) else 0
