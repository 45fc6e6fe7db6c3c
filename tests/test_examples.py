"""Every example runs with --smoke; the long runs that check quality are marked slow."""

import importlib.util
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
    spec.loader.exec_module(module)
    return module


@needs_shakespeare
def test_shakespeare_char_smoke(tmp_path):
    result = load_example("shakespeare_char").main(["--data", str(SHAKESPEARE), "--out", str(tmp_path), "--smoke"])
    assert result["steps"] == 20 and result["val_loss"] < 5.55  # below uniform over bytes


@needs_shakespeare
@pytest.mark.slow
def test_shakespeare_char_reaches_nanogpt_validation_loss(tmp_path):
    """nanoGPT reports about 1.88 for this configuration after 2000 steps."""
    result = load_example("shakespeare_char").main(["--data", str(SHAKESPEARE), "--out", str(tmp_path)])
    assert result["val_loss"] < 1.95


def test_dew_tokenize_command_writes_the_corpus(tmp_path):
    from dew.cli.main import main
    from dew.data import TokenCorpus

    (tmp_path / "text.txt").write_text("hello world\n\nsecond document\n" * 50)
    main(["tokenize", "--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "tokens"),
          "--tokenizer", "byte", "--val-fraction", "0.1", "--pack"])
    corpus = TokenCorpus.read(tmp_path / "tokens")
    assert corpus.vocab_size == 256 and corpus.eos_id is not None
    assert len(corpus.val) == int(0.1 * (len(corpus.train) + len(corpus.val)))
