"""dew.host_memory: XLA:CPU's per-execution temporaries stop being page-faulted in every call."""

import os
import subprocess
import sys

import pytest

import dew.host_memory as host_memory

glibc_linux = pytest.mark.skipif(
    not host_memory.on_glibc_linux(),
    reason="the setting applies to glibc's malloc on Linux only",
)

# a jitted function whose temporaries (two cumulative sums of a 64 MB array) make one block of
# ~128 MB: more than a thread arena holds, so glibc's defaults map and unmap it on every call
PROGRAM = """
import resource, statistics
import dew, dew.host_memory
import jax, jax.numpy as jnp

@jax.jit
def f(x):
    return jnp.cumsum(jnp.cumsum(x, axis=0), axis=1).sum()

x = jnp.ones((4096, 4096), jnp.float32)
for _ in range(10):  # the heap settles within the first few calls
    f(x).block_until_ready()
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(dew.host_memory.applied, statistics.median(faults))
"""


def _faults_per_call(setting: str) -> tuple[bool, float]:
    env = dict(os.environ, DEW_HOST_MEMORY=setting, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the program as users run it (the suite's own flags trade run time for compile time)
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", float(faults)


@glibc_linux
def test_importing_dew_keeps_a_large_temporary_block_mapped_between_calls():
    applied, faults = _faults_per_call("reuse")
    assert applied
    # the median call: a stray call may still find the block moved while the heap settles
    # negative control: glibc's defaults fault the ~128 MB block (32,768 pages) in on every call
    default_applied, default_faults = _faults_per_call("system")
    assert not default_applied
    assert default_faults > 20_000, default_faults
    assert faults < 1_000, faults


def test_an_unknown_setting_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(host_memory, "applied", False)
    monkeypatch.setenv("DEW_HOST_MEMORY", "fast")
    with pytest.raises(ValueError, match="DEW_HOST_MEMORY='fast'.*'reuse'.*'system'"):
        host_memory.reuse_freed_memory()


def test_system_keeps_glibc_defaults(monkeypatch):
    monkeypatch.setattr(host_memory, "applied", False)
    monkeypatch.setenv("DEW_HOST_MEMORY", "system")
    assert host_memory.reuse_freed_memory() is False
