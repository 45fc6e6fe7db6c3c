"""Joining JAX's process pool: one call at the top of a script that every process of a run executes.

`prepare_process(multi_host=True)` finds the pool from the environment and calls
`jax.distributed.initialize` with it:
- the variables `dew launch` sets for each process it starts (`DEW_COORDINATOR_ADDRESS`,
  `DEW_NUM_PROCESSES`, `DEW_PROCESS_ID` and, where it assigns accelerators, `DEW_LOCAL_DEVICE_IDS`);
- otherwise JAX's own detection of Slurm, Open MPI, Kubernetes and Cloud TPU environments.
It must run before the first device array exists, because JAX fixes the device list the moment
a backend starts; calling it later raises instead of silently training as one process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

COORDINATOR = "DEW_COORDINATOR_ADDRESS"
NUM_PROCESSES = "DEW_NUM_PROCESSES"
PROCESS_ID = "DEW_PROCESS_ID"
LOCAL_DEVICE_IDS = "DEW_LOCAL_DEVICE_IDS"
LAUNCH_VARIABLES = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """Where a process finds its pool: the coordinator, the pool's size, its rank and its devices.

    None for a setting means JAX detects it from the cluster environment (Slurm, MPI, TPU)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> PoolSettings:
        """The settings `dew launch` wrote into the environment, or all None where it wrote none."""
        environ = os.environ if environ is None else environ
        given = [name for name in LAUNCH_VARIABLES if environ.get(name)]
        if not given:
            return cls()
        if len(given) != len(LAUNCH_VARIABLES):
            missing = [name for name in LAUNCH_VARIABLES if name not in given]
            raise ValueError(f"The environment sets {given} but not {missing}; dew launch sets all three. Set the missing ones or unset the others.")
        devices = environ.get(LOCAL_DEVICE_IDS)
        settings = cls(
            coordinator=environ[COORDINATOR],
            num_processes=_integer(environ, NUM_PROCESSES),
            process_id=_integer(environ, PROCESS_ID),
            local_device_ids=tuple(int(d) for d in devices.split(",")) if devices else None,
        )
        if not 0 <= settings.process_id < settings.num_processes:
            raise ValueError(f"{PROCESS_ID}={settings.process_id} must be in [0, {NUM_PROCESSES}={settings.num_processes}).")
        return settings

    @property
    def loopback(self) -> bool:
        """Whether the coordinator is on this machine's loopback interface (a local launch)."""
        return self.coordinator is not None and self.coordinator.rsplit(":", 1)[0] in LOOPBACK_HOSTS


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {environ[name]!r}.") from None


def backend_started() -> bool:
    """Whether a JAX backend exists yet (after it does, the process can no longer join a pool)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def prepare_process(multi_host: bool = False, *, environ: Mapping[str, str] | None = None, timeout_s: int = 300) -> None:
    """Join the process pool this process belongs to, before any device array exists.

    Args:
      multi_host: False does nothing (one process, its own devices); True joins the pool the
        environment describes (see the module docstring).
      environ: the environment to read (default: os.environ).
      timeout_s: how long to wait for every process to reach the coordinator.

    Raises:
      RuntimeError: a JAX backend has already started, or the pool was already joined.
      ValueError: the environment describes no pool, or an inconsistent one.
    """
    if not multi_host:
        return
    import jax

    if jax.distributed.is_initialized():
        raise RuntimeError("prepare_process(multi_host=True) ran twice: this process already joined its pool.")
    if backend_started():
        raise RuntimeError(
            "prepare_process(multi_host=True) must run before any device array exists, but a JAX backend "
            "has already started (something called jax.devices(), created an array or ran a jitted "
            "function first). Call it first thing in main(), before building data, models or meshes."
        )
    settings = PoolSettings.from_environment(environ)
    options: dict = dict(initialization_timeout=timeout_s)
    if settings.coordinator is not None:
        options.update(coordinator_address=settings.coordinator, num_processes=settings.num_processes,
                       process_id=settings.process_id)
        if settings.local_device_ids is not None:
            options["local_device_ids"] = list(settings.local_device_ids)
        if settings.loopback:  # a local launch: the coordinator listens on loopback only
            options["coordinator_bind_address"] = settings.coordinator
    try:
        jax.distributed.initialize(**options)
    except ValueError as error:
        if settings.coordinator is not None:
            raise
        raise ValueError(
            "prepare_process(multi_host=True) found no process pool: the environment has no "
            f"{COORDINATOR} (set by dew launch) and JAX detected no Slurm, MPI, Kubernetes or Cloud "
            f"TPU environment ({error}). Start the script with dew launch, or call prepare_process() "
            "without multi_host for a single process."
        ) from None
