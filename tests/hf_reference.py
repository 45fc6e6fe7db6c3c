"""Reading an export back in transformers, in the reference environment (`reference` tests).

`tools/hf_check_export.py` runs under `.venv-ref`'s Python, loads the exported directory with
transformers and prints its logits for the given ids; the tests compare them with Dew's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
REF_PYTHON = ROOT / ".venv-ref/bin/python"


def moved_variables(bundle, seed: int = 1, scale: float = 0.05):
    """The bundle's variables moved off their loaded values, as a trained model's would be."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape).astype(np.float32)),
        nn.unbox(bundle.variables))


def transformers_reads(export: Path, ids: np.ndarray) -> dict:
    """What transformers computes on `export` for `ids` (model_type, logits, tokenizer_vocab);
    skips when the reference environment is missing."""
    if not REF_PYTHON.exists():
        pytest.skip(f"{REF_PYTHON} is missing; create it as tools/hf_decoder_fixtures.py describes")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [str(REF_PYTHON), str(ROOT / "tools/hf_check_export.py"), str(export), "--ids", json.dumps(np.asarray(ids).tolist())],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


FIXTURES = ROOT / "tests/fixtures/hf"  # tools/hf_decoder_fixtures.py writes one directory per family
TOLERANCE = 1e-4  # float32 logits against transformers'
_APPLY = {}  # one jitted apply per model, shared by every test that reads logits


def reference(name: str):
    """What transformers recorded for fixture `name`: input_ids, logits, greedy tokens, ..."""
    return np.load(FIXTURES / name / "reference.npz")


def logits(model, variables, ids) -> np.ndarray:
    """The model's logits for `ids`, through one jitted apply per model."""
    if model not in _APPLY:
        _APPLY[model] = jax.jit(model.apply)
    return np.asarray(_APPLY[model](variables, jnp.asarray(ids)))


def far(got, want) -> bool:
    """Whether logits differ by far more than the parity tolerance (a negative control's check)."""
    return np.abs(got - want).max() > 100 * TOLERANCE
