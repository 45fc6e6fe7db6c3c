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


def test_the_demo_learns_the_curve(tmp_path, capsys):
    from dew.cli import demo

    demo.run(out=str(tmp_path / "demo"), steps=200)
    out = capsys.readouterr().out
    worst = float(out.split("largest error on these points:")[1].split()[0])
    assert worst < 0.35  # the untrained MLP is off by about 1.2 on these points
    assert (tmp_path / "demo" / "checkpoints" / "200").is_dir()
    assert (tmp_path / "demo" / "tracking" / "plots" / "train_loss.png").exists()
