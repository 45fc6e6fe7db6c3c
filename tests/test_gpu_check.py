"""benchmarks/gpu_check.py on the CPU (--quick): its attention rows compare each kernel with the
reference and carry a negative control, a section's failure is reported and the next still runs,
and a spent budget skips sections instead of overrunning."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _run(tmp_path, *args):
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--quick", *args], check=True,
                   capture_output=True, text=True, timeout=300)
    return [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]


def test_attention_rows_match_the_reference_and_catch_the_other_causality(tmp_path):
    (record,) = _run(tmp_path, "--sections", "attention", "--short")
    matmul, *rows = record["rows"]
    assert matmul["platform"] == "cpu" and matmul["default_precision_rel_error"] < 1e-5
    assert {row["case"] for row in rows} == {"causal", "causal_window", "causal_lengths", "bidirectional"}
    for row in rows:
        assert row["auto_resolves_to"] == "xla"  # no cuDNN off an NVIDIA GPU
        for impl in ("auto", "xla"):
            entry = row[impl]
            assert entry["max_abs_error"] < 0.05 and max(entry["grad_max_rel_error"]) < 0.02, (row["case"], impl)
            assert entry["negative_control_error"] > 1.0
            assert entry["runs_cudnn_custom_call"] is False
        assert "blockwise" not in row  # --short


def test_a_failing_section_is_reported_and_a_spent_budget_skips_the_rest(tmp_path):
    records = _run(tmp_path, "--sections", "attention,offload", "--budget", "0")
    assert [r["error"] for r in records] == ["skipped: the run's budget is spent"] * 2
    (tmp_path / "gpu_check.jsonl").unlink()
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: serve_torch would run instead of failing")
    # serve_torch needs torch, which the default environment does not have: an error, not a crash
    (failed,) = _run(tmp_path, "--sections", "serve_torch")
    assert failed["section"] == "serve_torch" and failed["error"] == "exit 1"
    assert "No module named 'torch'" in (tmp_path / "serve_torch.log").read_text()
