"""The package's front door: a cheap import, the dew command and the demo."""

import subprocess
import sys

import pytest


def test_import_dew_is_lazy_and_initializes_no_backend():
    code = (
        "import sys, dew\n"
        "heavy = [m for m in ('jax', 'flax', 'optax', 'orbax', 'grain', 'torch', 'transformers', 'tyro') if m in sys.modules]\n"
        "print(heavy)\n"
        "assert 'Trainer' in dir(dew)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_public_names_resolve_and_unknown_names_fail():
    import dew

    for name in dew.__all__:
        assert getattr(dew, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        dew.Nope


def test_dew_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "dew.cli.main", "--help"], check=True, capture_output=True,
                         text=True).stdout
    for command in ("demo", "tokenize"):
        assert command in out


def test_the_demo_curve_part_learns_the_curve(tmp_path, capsys):
    from dew.cli import demo

    demo.run(out=str(tmp_path / "demo"), parts=("curve",), curve_steps=200)
    out = capsys.readouterr().out
    worst = float(out.split("largest error on these points:")[1].split()[0])
    assert worst < 0.35  # the curve spans [-1.25, 1.25]; an untrained MLP is off by about that
    assert (tmp_path / "demo" / "curve" / "checkpoints" / "200").is_dir()
    assert (tmp_path / "demo" / "curve" / "tracking" / "plots" / "train_loss.png").exists()


def test_the_demo_lm_part_saves_a_run_that_dew_pipeline_rebuilds(tmp_path, capsys):
    import json

    from dew.cli import demo

    demo.run(out=str(tmp_path / "demo"), parts=("lm",), lm_steps=30)
    out = capsys.readouterr().out
    run = tmp_path / "demo" / "lm" / "run"
    assert sorted(p.name for p in run.iterdir()) == ["30", "run.json", "tracking"]
    record = json.loads((run / "run.json").read_text())
    assert record["model"]["target"] == "dew.nn.backbones.causal_transformer.CausalTransformer"
    assert record["objective"]["target"] == "dew.objectives.lm.LMObjective" and record["tokenizer"] == "byte"
    assert "greedy continuation of 'The return statement'" in out
    assert float(out.split("validation loss ")[1].split()[0]) < 4.0  # uniform over bytes is 5.55


@pytest.mark.slow
def test_the_full_demo_writes_real_words(tmp_path, capsys):
    """The default demo (a few minutes): its continuation is made of words from the corpus."""
    import re

    from dew.cli import demo
    from dew.data.corpora import help_topics_text

    demo.run(out=str(tmp_path / "demo"))
    out = capsys.readouterr().out
    # The continuation runs up to the next part's "== " header (the digits part's log lines follow).
    text = out.split("greedy continuation of 'The return statement':")[1].split("\n== ")[0]
    assert "== diffusion" in out and "samples.png" not in text
    vocabulary = set(re.findall(r"[a-z]+", help_topics_text().lower()))
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 10
    assert sum(w in vocabulary for w in words) / len(words) > 0.8
    assert float(out.split("validation loss ")[1].split()[0]) < 1.6


def test_the_demo_digits_part_writes_a_sample_grid(tmp_path, capsys):
    from PIL import Image

    from dew.cli import demo

    demo.run(out=str(tmp_path / "demo"), parts=("digits",), digits_steps=6, digits_sample_steps=4)
    grid = Image.open(tmp_path / "demo" / "digits" / "samples.png")
    assert grid.size == (10 * 32 + 9 * 2, 4 * 32 + 3 * 2)  # 10 digits x 4 samples, 32 px each, 2 px between
    assert "each column is one digit" in capsys.readouterr().out


def test_the_lm_benchmark_falls_back_to_the_corpus_every_install_has(tmp_path, monkeypatch):
    """A fresh clone has no shared data folder: lm_train reads Python's help topics and says so."""
    from pathlib import Path

    import numpy as np

    from dew.data.corpora import HELP_TOPICS, help_topics_text

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import lm_train

    monkeypatch.setattr(lm_train, "SHARED_DATA", tmp_path / "missing" / "tinyshakespeare.txt")
    corpus, name = lm_train.load_corpus(None, synthetic=False)
    assert name == HELP_TOPICS
    assert bytes(corpus.astype(np.uint8)) == help_topics_text().encode("utf-8")
    (tmp_path / "own.txt").write_text("to be or not to be")
    assert lm_train.load_corpus(str(tmp_path / "own.txt"), synthetic=False)[1] == "own.txt"
    with pytest.raises(SystemExit, match="no corpus at .*elsewhere.txt"):
        lm_train.load_corpus(str(tmp_path / "elsewhere.txt"), synthetic=False)


def test_the_moe_benchmark_counts_a_tokens_active_parameters_as_dews_models_hold_them(monkeypatch):
    """moe_train's FLOP count: a token multiplies by its top_k experts, the router and the rest of
    the decoder, so the dense floor (one SwiGLU of the active width) plus the routers is the count,
    and the mixture adds only the other experts' weights."""
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_train as m

    def params(model):
        shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        return sum(x.size for x in jax.tree_util.tree_leaves(shapes["params"]))

    routers = m.SIZE.layers * m.SIZE.width * m.EXPERTS
    idle = m.SIZE.layers * (m.EXPERTS - m.TOP_K) * 3 * m.SIZE.width * m.SIZE.mlp
    assert m.active_params() == params(m.dew_model(dense=True)) + routers
    assert m.active_params() + idle == params(m.dew_model()) == 20_201_088
