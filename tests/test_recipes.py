"""The LM and diffusion recipes: every field a flag in a readable --help, nested overrides, --config FILE
to start from, and a short run of each that dew.pipeline reloads."""

import contextlib
import dataclasses
import importlib.util
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import dew
from dew.config.command_line import parse, read_config_file

ROOT = Path(__file__).resolve().parents[1]


def recipe_module(kind):
    name = f"_recipe_{kind}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / kind / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def flags(cls, prefix=""):
    """Every leaf field of a (nested) recipe dataclass as the flag tyro gives it."""
    for field in dataclasses.fields(cls):
        default = field.default
        if dataclasses.is_dataclass(default):
            yield from flags(type(default), prefix + field.name + ".")
        else:
            yield "--" + (prefix + field.name).replace("_", "-")


@pytest.mark.parametrize("kind, recipe", [("lm", "LMRecipe"), ("diffusion", "DiffusionRecipe")])
def test_help_lists_every_field_with_its_default(kind, recipe, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    cls = getattr(recipe_module(kind), recipe)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        parse(cls, ["--help"])
    text = printed.getvalue()
    expected = list(flags(cls))
    assert len(expected) > 25 and "--optim.learning-rate" in expected
    missing = [flag for flag in expected if flag not in text]
    assert missing == []
    assert "--config FILE" in text and "(default: " in text


def test_nested_flags_override_a_config_file_that_overrides_the_defaults(tmp_path):
    LMRecipe = recipe_module("lm").LMRecipe
    start = tmp_path / "start.toml"
    start.write_text('ema_decay = 0.9\n[optim]\nlearning-rate = 0.02\nwarmup_steps = 5\n'
                     '[trainer]\nsteps = 50\nxla_flags = ["--xla_cpu_enable_fast_math=false"]\n')
    recipe = parse(LMRecipe, ["--config", str(start), "--optim.learning-rate", "3e-4", "--model.num-layers", "2"])
    assert recipe.optim.learning_rate == 3e-4 and recipe.optim.warmup_steps == 5 and recipe.trainer.steps == 50
    assert recipe.model.num_layers == 2 and recipe.ema_decay == 0.9
    assert recipe.trainer.xla_flags == ("--xla_cpu_enable_fast_math=false",)
    assert recipe.optim.weight_decay == LMRecipe().optim.weight_decay  # untouched settings keep the defaults

    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"optim": {"learning_rat": 0.1}}))
    with pytest.raises(ValueError, match=r"wrong.json: 'optim.learning_rat' names no setting.*'optim.learning_rate'"):
        read_config_file(LMRecipe, wrong)
    wrong.write_text(json.dumps({"trainer": {"steps": "many"}}))
    with pytest.raises(TypeError, match="trainer.steps holds int; got 'many'"):
        read_config_file(LMRecipe, wrong)


def test_a_short_lm_recipe_run_reloads_with_dew_pipeline_and_reruns_from_its_recipe_file(tmp_path):
    module = recipe_module("lm")
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 200)
    args = ["--data.text", str(text), "--data.seq-len", "16", "--trainer.checkpoint-dir", str(tmp_path / "runs"),
            "--trainer.steps", "4", "--trainer.batch-size", "8", "--trainer.log-every", "2",
            "--trainer.eval-every", "4", "--trainer.checkpoint-every", "2", "--model.emb-features", "32",
            "--model.num-layers", "1", "--model.num-heads", "2", "--model.mlp-features", "64",
            "--prompt", "the ", "--new-tokens", "6"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run = module.main(parse(module.LMRecipe, args))
    assert run == tmp_path / "runs" / "lm"
    assert {"run.json", "recipe.json", "tokens", "tracking", "4"} <= {p.name for p in run.iterdir()}
    reported = json.loads(printed.getvalue().strip().splitlines()[-1])
    task = dew.pipeline(run, ema=False)
    assert task(["the "], 6, seed=0).text[0] == reported["continuation"] and len(reported["continuation"]) == 6
    # the recorded recipe starts the next run: four more steps continue this one
    again = parse(module.LMRecipe, ["--config", str(run / "recipe.json"), "--trainer.steps", "6"])
    assert dataclasses.replace(again, trainer=dataclasses.replace(again.trainer, steps=4)) == parse(module.LMRecipe, args)
    with contextlib.redirect_stdout(io.StringIO()):
        module.main(again)
    assert json.loads((run / "run.json").read_text())["trainer"]["steps"] == 6 and (run / "6").is_dir()


def test_a_short_diffusion_recipe_run_reloads_with_dew_pipeline(tmp_path):
    pytest.importorskip("sklearn")
    from PIL import Image

    from dew.eval.image_metrics import image_grid

    module = recipe_module("diffusion")
    args = ["--trainer.checkpoint-dir", str(tmp_path), "--trainer.name", "digits", "--trainer.steps", "3",
            "--trainer.batch-size", "8", "--trainer.eval-every", "None", "--data.image-size", "8",
            "--data.channels", "1", "--model.patch-size", "2", "--model.emb-features", "32",
            "--model.num-layers", "1", "--model.num-heads", "2", "--sample-steps", "2", "--ema-decay", "0.5"]
    with contextlib.redirect_stdout(io.StringIO()):
        run = module.main(parse(module.DiffusionRecipe, args))
    task = dew.pipeline(run)  # the EMA copy
    drawn = task(list(range(10)), steps=2, seed=0).host().images
    assert drawn.shape == (10, 8, 8, 1)
    saved = np.asarray(Image.open(run / "samples.png"))
    np.testing.assert_array_equal(saved, image_grid(drawn)[..., 0])
