"""Test set-up: the CPU backend with 8 virtual devices, so mesh tests run on any machine, and a
Hugging Face Hub that is offline and empty, so no test can reach the network: a test that needs a
Hub repository populates its own cache (see `hub_cache`).

Each test module's compiled programs are dropped when the module ends (`_drop_compiled_programs`).
XLA:CPU maps every executable's code and constants into memory areas of their own, and a worker
that kept every program of several hundred tests alive would pass the kernel's limit on mappings
per process (vm.max_map_count, 65530 by default), where the next compilation dies with a
segmentation fault.

The default run compiles with XLA's cheap LLVM settings (`pytest_configure`); every result a test
checks is computed in that one setting, and the slow and reference runs use XLA's defaults.
"""

import gc
import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="dew-hub-cache-")

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (XLA reads XLA_FLAGS when the backend starts, at the first device use)

jax.config.update("jax_platforms", "cpu")


import pytest  # noqa: E402

QUICK_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)


def pytest_configure(config):
    """A run that leaves the slow tests out compiles cheaply (QUICK_COMPILE): LLVM's cheap settings
    and XLA:CPU's older elemental emitters in place of its MLIR fusion emitters, as its tiny
    programs cost far more to compile than to run (the LLVM settings took the default suite from
    about 2,000 s to 1,075 s; the emitters, on a slower host, from 1,548 s to 1,085 s, halving the
    compile time of test_finetune and test_serving). `make test-slow` and `make test-reference`,
    whose tests train and sample for real, keep XLA's defaults, as does a run whose XLA_FLAGS set
    an optimization level."""
    flags = os.environ["XLA_FLAGS"]
    left_out = (config.option.markexpr or "").replace("not slow", "").replace("not reference", "")
    selects_slow_tests = not config.option.markexpr or "slow" in left_out or "reference" in left_out
    if not selects_slow_tests and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {QUICK_COMPILE}"


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """Free the executables a test module compiled once it ends (see the module docstring)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache directory that `huggingface_hub` reads, offline, for one test.

    Returns a function ``put(repo_id, files, revision="main", commit=None) -> commit`` that lays a
    snapshot of `files` (name -> source path) out the way the Hub's cache does (refs/REVISION
    holding the commit, snapshots/COMMIT/NAME).
    """
    import hashlib
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def put(repo_id, files, revision="main", commit=None):
        commit = commit or hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for name, source in files.items():
            shutil.copyfile(source, snapshot / name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        return commit

    return put
