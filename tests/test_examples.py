"""Every example runs with --smoke; the long runs that check quality are marked slow."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
needs_shakespeare = pytest.mark.skipif(
    not SHAKESPEARE.exists(), reason=f"tinyshakespeare is not at {SHAKESPEARE} (the shared data folder)"
)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_shakespeare(out, *args) -> dict:
    """examples/shakespeare_char.py run as its users run it, in a process of its own on the one CPU
    device (the suite's eight virtual devices would each compute nanoGPT's batch of 12 whole, as 12
    rows do not split over 8); its JSON line."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "shakespeare_char.py"), "--data", str(SHAKESPEARE),
         "--out", str(out), *args],
        env={**os.environ, "XLA_FLAGS": " ".join(flags)}, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


@needs_shakespeare
def test_shakespeare_char_smoke(tmp_path):
    result = run_shakespeare(tmp_path, "--smoke")
    assert result["steps"] == 20 and result["val_loss"] < 5.55  # below uniform over bytes


@needs_shakespeare
@pytest.mark.slow
def test_shakespeare_char_reaches_nanogpt_validation_loss(tmp_path):
    """nanoGPT reports about 1.88 for this configuration after 2000 steps."""
    assert run_shakespeare(tmp_path)["val_loss"] < 1.95


def test_dew_tokenize_command_writes_the_corpus(tmp_path):
    from dew.cli.main import main
    from dew.data import TokenCorpus

    (tmp_path / "text.txt").write_text("hello world\n\nsecond document\n" * 50)
    main(["tokenize", "--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "tokens"),
          "--tokenizer", "byte", "--val-fraction", "0.1", "--pack"])
    corpus = TokenCorpus.read(tmp_path / "tokens")
    assert corpus.vocab_size == 256 and corpus.eos_id is not None
    assert len(corpus.val) == int(0.1 * (len(corpus.train) + len(corpus.val)))


def test_readme_demo_smoke_trains_resumes_prefers_and_samples(tmp_path, monkeypatch):
    """The tour's four parts, at smoke sizes: each shows what its printout claims."""
    import math

    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # everything must land under --out, nothing in the working directory
    out = tmp_path / "out"
    results = load_example("readme_demo").main(["--out", str(out), "--smoke"])

    lm, resumed = results["lm"], results["resume"]
    assert lm["checkpoint_steps"] == [16]
    assert lm["last_loss"] < lm["first_loss"] - 0.5 and lm["val_loss"] < math.log(256) - 0.5
    # The rebuilt trainer starts after the checkpointed step, from the trained weights, and stops at
    # the absolute target.
    assert resumed["restored_from"] == 16 and resumed["first_step"] == 17 and resumed["final_step"] == 24
    assert resumed["first_resumed_loss"] < math.log(256) - 0.5
    assert resumed["checkpoint_steps"] == [16, 24] and len(resumed["continuation"]) > 0

    dpo = results["dpo"]
    assert dpo["held_out_margin_before"] == 0.0  # the policy starts as its own reference
    assert dpo["held_out_margin_after"] > dpo["held_out_margin_before"]
    assert dpo["train_margin_last"] > dpo["train_margin_first"]

    flow = results["flow"]
    assert flow["last_loss"] < flow["first_loss"]
    assert flow["trained"]["nearest_center"] < 0.6 * flow["untrained"]["nearest_center"]
    assert flow["trained"]["near_a_mode"] > flow["untrained"]["near_a_mode"]
    assert (out / "flow" / "samples.npy").exists() and (out / "lm" / "checkpoints" / "24").is_dir()
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_readme_demo_full_run_learns_each_part(tmp_path):
    """The default sizes (about two minutes): each part reaches a level a reader can see."""
    results = load_example("readme_demo").main(["--out", str(tmp_path)])
    assert results["lm"]["val_loss"] < 1.6  # nats per byte; uniform is 5.55
    assert results["resume"]["first_step"] == 501 and results["resume"]["final_step"] == 800
    assert results["dpo"]["held_out_margin_after"] > 1.0 and results["dpo"]["held_out_accuracy_after"] > 0.8
    trained, data = results["flow"]["trained"], results["flow"]["data"]
    assert trained["near_a_mode"] > 0.85 and trained["modes_covered"] == 8
    assert trained["nearest_center"] < 1.5 * data["nearest_center"]


def test_sft_lora_smoke_trains_the_adapter_alone_and_exports_it(tmp_path):
    from dew.interop import Pretrained
    from dew.nn.adapters import LoRA

    result = load_example("sft_lora").main(["--out", str(tmp_path), "--smoke"])
    assert result["steps"] == 30 and result["last_loss"] < result["first_loss"] - 0.3
    assert result["trained_tensors"] < result["frozen_tensors"] / 4
    adapter = LoRA.load(result["adapter"])
    assert adapter.rank == 8 and adapter.modules == (  # "all-linear", written out as PEFT reads it
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    reloaded = Pretrained.load(tmp_path / "base").adapt(adapter, key=0)
    assert sorted(reloaded.variables) == ["base", "params"]


def test_evaluate_and_serve_smoke_scores_both_runs_and_the_served_decoder_matches_local(tmp_path):
    import json
    import math

    report = load_example("evaluate_and_serve").main(["--smoke", "--report", str(tmp_path / "report.json")])
    assert json.loads((tmp_path / "report.json").read_text()) == report
    decoder, images = (next(r for r in report.values() if r["kind"] == kind) for kind in ("decoder", "images"))
    # a 4-step byte model is barely better than uniform over 256 bytes, and no worse than a few times it
    assert 1.0 < decoder["perplexity"] < 4 * 256 and decoder["held_out_tokens"] > 1000
    served = decoder["served"]
    assert served["equal"] and served["served"] == served["local"] and len(served["served"]) == 3
    assert served["usage"]["completion_tokens"] == 3 * 4
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        assert "pip install 'dewml[eval-harness]'" in decoder["lm_eval"]["skipped"]
    else:
        assert set(decoder["lm_eval"]) == {"dew_tiny_mc", "dew_tiny_perplexity"}
    assert images["samples"] == 16 and math.isfinite(images["fid_random_conv"]) and images["fid_random_conv"] > 0
    assert -1.0 <= images["sample_range"][0] <= images["sample_range"][1] <= 1.0


def test_train_diffusion_smoke_trains_a_latent_text_run_and_draws_from_it_reloaded(tmp_path):
    from PIL import Image

    result = load_example("train_diffusion").main(["--smoke", "--out", str(tmp_path)])
    run = Path(result["run"])
    assert sorted(p.name for p in run.iterdir()) == ["3", "autoencoder", "run.json", "text_encoder"]
    assert result["steps"] == 3 and result["latent_shape"] == [8, 8, 4]  # 16x16x1 digits in the VAE's latents
    assert result["distinct_prompt_encodings"] == 10  # random frozen CLIP weights tell the ten prompts apart
    with Image.open(result["samples"]) as grid:
        assert grid.size == (2 * 16, 10 * 16)  # ten prompts by two samples
    assert all(0.0 <= score <= 1.0 for score in result["prompted_digit_accuracy"].values())


@pytest.mark.slow
def test_train_diffusion_draws_the_prompted_digit(tmp_path):
    """Guided draws show the digit their prompt names (chance is 10%); without guidance, less often.
    (Measured: 0.99 guided, 0.92 without guidance, 100 draws each, in about 16 minutes on 2 CPU cores.)"""
    result = load_example("train_diffusion").main(["--out", str(tmp_path)])
    scores = result["prompted_digit_accuracy"]
    assert scores["guided"] >= 0.6 and scores["unguided"] < scores["guided"], scores


def test_train_flowers_smoke_trains_saves_and_draws_from_the_reloaded_run(tmp_path):
    """The Getting started program on a tiny directory that TFDS itself prepared (JPEG images that
    are not square, as flowers' are; tools/tfds_fixture.py)."""
    from test_image_data import TFDS_FIXTURE

    data = TFDS_FIXTURE / "dew_toy" / "1.0.0"
    result = load_example("train_flowers").main(["--data", str(data), "--run", str(tmp_path / "run"), "--batch", "8",
                                                 "--samples", "2", "--smoke"])
    assert result["files"] == ["2", "run.json", "samples.png"] and result["steps"] == 2
    assert result["shape"] == [2, 16, 16, 3]
