"""DiffusionRunConfig: a diffusion run saved in one record, reloaded by TextToImage.from_run and
dew.pipeline (text-conditioned latent runs included), and its bad inputs refused before compiling."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew import Checkpoints, Dataset, Trainer
from dew.config import ModelConfig, TrainerConfig
from dew.data import Digits, Loading
from dew.diffusion import presets
from dew.inference import TextToImage
from dew.interop.autoencoders import PretrainedAutoencoder
from dew.interop.text_encoders import PretrainedTextEncoder
from dew.nn.backbones import CausalTransformer, SimpleDiT
from dew.nn.backbones.mmdit import MMDiT
from dew.nn.vae import AutoencoderKL
from dew.objectives.diffusion import DiffusionRunConfig
from dew.objectives.lm import LMObjective
from dew.objectives.text_condition import TextCondition
from dew.sampling import CFG, Euler, Heun

CLIP = pathlib.Path(__file__).parent / "fixtures" / "text_encoders" / "clip"
VAE = pathlib.Path(__file__).parent / "fixtures" / "vae" / "sd"
PROMPTS = ["a handwritten seven", "the digit 3", None]


def tiny_autoencoder(channels=3, latent_channels=4, seed=0):
    model = AutoencoderKL(in_channels=channels, out_channels=channels, block_out_channels=(8, 8), layers_per_block=1,
                          latent_channels=latent_channels, norm_num_groups=4, mid_block_add_attention=False)
    variables = model.init(jax.random.key(seed), jnp.zeros((1, 8, 8, channels)))
    return PretrainedAutoencoder.from_model(model, variables)


def train(config, batch, directory, steps=2):
    objective = config.build()
    data = Dataset.from_records(batch, batch=len(next(iter(batch.values()))))
    checkpoints = Checkpoints(str(directory), keep=1)
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), checkpoints=checkpoints).fit(
        data, steps=steps, log_every=steps, checkpoint_every=steps)
    checkpoints.wait()
    config.save(directory)
    return objective, state


def text_latent_run(tmp_path):
    condition = TextCondition(PretrainedTextEncoder.load(CLIP), pooled="pooled")
    config = DiffusionRunConfig(
        model=ModelConfig.from_model(MMDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2,
                                           text_features=32, condition_features=32)),
        data=None, trainer=TrainerConfig(checkpoint_dir=str(tmp_path / "run")), preset=presets.Flow(),
        text=condition, autoencoder=tiny_autoencoder(), sample_shape=(8, 8, 3), ema_decay=0.5,
        solver=Euler(), steps=3, guidance=2.0,
    )
    images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    captions = ["a handwritten seven", "the digit 7", "a three", "the digit 3"]
    batch = {"image": images, **config.build().inputs.tokenize(captions)}
    objective, state = train(config, batch, tmp_path / "run")
    return config, objective, state


def test_a_text_conditioned_latent_run_reloads_bitwise(tmp_path):
    config, objective, state = text_latent_run(tmp_path)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["2", "autoencoder", "run.json", "text_encoder"]
    expected = objective.pipeline(state)(PROMPTS, steps=3, solver=Euler(), guidance=CFG(2.0), seed=5).host()
    assert expected.images.shape == (3, 8, 8, 3) and expected.latents.shape == (3, 4, 4, 4)
    for task in (dew.pipeline(run), TextToImage.from_run(str(run))):
        assert isinstance(task, TextToImage)
        assert (task.steps, task.solver, task.guidance) == (3, Euler(), CFG(2.0))  # the recorded defaults
        drawn = task(PROMPTS, seed=5).host()
        np.testing.assert_array_equal(drawn.images, expected.images)
        np.testing.assert_array_equal(drawn.latents, expected.latents)
    # the prompts steer the draw: other prompts from the same noise draw something else
    other = task(["the digit 3", "a handwritten seven", None], seed=5).host()
    assert not np.array_equal(other.images[:2], drawn.images[:2])
    live = TextToImage.from_run(str(run), ema=False)(PROMPTS, seed=5).host()
    assert not np.array_equal(live.images, expected.images)  # ema=False reads the live weights


def test_the_getting_started_program_runs_on_a_small_image_set(tmp_path, monkeypatch):
    """The spec's program with TFDS flowers swapped for 16x16 digits and the sizes shrunk for a CPU."""
    monkeypatch.chdir(tmp_path)
    run = pathlib.Path("runs/flowers-run")
    config = DiffusionRunConfig(
        model=ModelConfig.from_model(SimpleDiT(patch_size=4, emb_features=32, num_layers=1, num_heads=2,
                                               dtype=jnp.bfloat16)),
        data=Digits(image_size=16, channels=3, loading=Loading(workers=0, threads=1, read_buffer=2)),
        trainer=TrainerConfig(checkpoint_dir=str(run), batch_size=8, steps=2, keep=1),
        preset=presets.EDM(regime="pixel"),
        text=None,
    )
    objective = config.build()
    assert objective.inputs.tokenize(["a flower"]) == {}  # unconditional: captions become no columns
    checkpoints = Checkpoints(str(run), keep=1)
    state = Trainer(objective, optax.adamw(2e-4), key=jax.random.key(0), checkpoints=checkpoints).fit(
        config.data.load(batch=8, tokenize=objective.inputs.tokenize), steps=2, log_every=2, checkpoint_every=2)
    checkpoints.wait()
    config.save(str(run))
    assert sorted(path.name for path in run.iterdir()) == ["2", "run.json"]
    task = TextToImage.from_run(str(run))
    images = task(["a flower", "another flower"], steps=4, solver=Heun(), key=jax.random.key(1)).host()
    assert images.images.shape == (2, 16, 16, 3) and int(state.updates) == 2
    assert float(np.abs(images.images).max()) <= 1.0 and images.latents is None
    same = objective.pipeline(state)(["a", "b"], steps=4, solver=Heun(), key=jax.random.key(1)).host()
    np.testing.assert_array_equal(images.images, same.images)
    recorded = json.loads((run / "run.json").read_text())
    assert recorded["objective"]["target"] == "dew.objectives.diffusion.DiffusionObjective"
    assert recorded["data"]["fields"]["image_size"] == 16


# --- bad input, before compiling ----------------------------------------------------------------------


def test_a_batch_without_the_caption_column_is_refused(tmp_path):
    condition = TextCondition(PretrainedTextEncoder.load(CLIP))
    config = DiffusionRunConfig(model=ModelConfig.from_model(MMDiT(patch_size=2, emb_features=32, num_layers=1,
                                                                    num_heads=2, text_features=32)),
                                data=None, trainer=TrainerConfig(), preset=presets.Flow(), text=condition,
                                sample_shape=(8, 8, 3))
    images = np.zeros((2, 8, 8, 3), np.uint8)
    trainer = Trainer(config.build(), optax.adam(1e-2), key=jax.random.key(0))
    with pytest.raises(ValueError, match="no caption column 'caption'.*tokenize=objective.inputs.tokenize"):
        trainer.fit(Dataset.from_records({"image": images, "label": np.zeros(2, np.int32)}, batch=2), steps=1)
    # with the captions tokenized by the objective's own inputs, the same data trains
    tokens = config.build().inputs.tokenize(["a seven", "a three"])
    assert set(tokens) == {"caption"} and tokens["caption"].shape == (2, 16)


def test_latents_the_backbone_cannot_take_are_refused():
    # 8x8 images -> 4x4 latents, which an 8-pixel patch does not tile
    with pytest.raises(ValueError, match=r"turns \(8, 8, 3\) images into \(4, 4, 4\) latents"):
        DiffusionRunConfig(model=ModelConfig.from_model(SimpleDiT(patch_size=8, emb_features=32, num_layers=1,
                                                                   num_heads=2)),
                           data=None, trainer=TrainerConfig(), preset=presets.Flow(), autoencoder=tiny_autoencoder(),
                           sample_shape=(8, 8, 3)).build()
    # the same backbone over pixels is fine
    DiffusionRunConfig(model=ModelConfig.from_model(SimpleDiT(patch_size=8, emb_features=32, num_layers=1, num_heads=2)),
                       data=None, trainer=TrainerConfig(), preset=presets.Flow(), sample_shape=(8, 8, 3)).build()


def test_an_autoencoder_that_cannot_be_stored_is_refused():
    model = AutoencoderKL(block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4)
    with pytest.raises(TypeError, match="PretrainedAutoencoder.from_model"):
        DiffusionRunConfig(model=ModelConfig.from_model(SimpleDiT(patch_size=2, emb_features=32, num_layers=1,
                                                                   num_heads=2)),
                           data=None, trainer=TrainerConfig(), preset=presets.Flow(), autoencoder=model)


def test_an_autoencoder_directory_is_read_wherever_an_autoencoder_is_taken(tmp_path, monkeypatch):
    from dew.inference import image
    from dew.objectives.base import Field, InputSpec
    from dew.objectives.diffusion import DiffusionObjective

    loaded = PretrainedAutoencoder.load(VAE)  # 16x16 images -> 4x4x4 latents
    backbone = SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2)
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    objective = DiffusionObjective(backbone, presets.Flow(), InputSpec(Field("image", (16, 16, 3))), autoencoder=str(VAE))
    assert isinstance(objective.autoencoder, PretrainedAutoencoder) and objective.model_shape == (4, 4, 4)
    np.testing.assert_array_equal(objective.to_model_space(images), loaded.encode(jnp.asarray(images) / 127.5 - 1))

    config = DiffusionRunConfig(model=ModelConfig.from_model(backbone), data=None, trainer=TrainerConfig(),
                                preset=presets.Flow(), autoencoder=VAE, sample_shape=(16, 16, 3))
    assert isinstance(config.autoencoder, PretrainedAutoencoder)
    assert config.build().model_shape == (4, 4, 4)

    variables = {"params": jax.tree.map(lambda w: w + 0.1, objective.init(jax.random.key(0))["params"])}
    by_directory = TextToImage(backbone, variables, objective.process, (4, 4, 4), autoencoder=str(VAE), steps=2)
    by_object = TextToImage(backbone, variables, objective.process, (4, 4, 4), autoencoder=loaded, steps=2)
    drawn = by_directory([None, None], seed=1).host()
    assert drawn.images.shape == (2, 16, 16, 3) and drawn.latents.shape == (2, 4, 4, 4)
    np.testing.assert_array_equal(drawn.images, by_object([None, None], seed=1).host().images)

    # a directory of something else, and latents the backbone cannot take, are refused up front
    with pytest.raises(FileNotFoundError, match="not a diffusers AutoencoderKL directory"):
        DiffusionObjective(backbone, presets.Flow(), InputSpec(Field("image", (16, 16, 3))), autoencoder=str(CLIP))
    with pytest.raises(ValueError, match=r"turns \(16, 16, 3\) images into \(4, 4, 4\) latents"):
        DiffusionObjective(SimpleDiT(patch_size=8, emb_features=32, num_layers=1, num_heads=2), presets.Flow(),
                           InputSpec(Field("image", (16, 16, 3))), autoencoder=str(VAE))
    monkeypatch.setattr(image, "_autoencoder_reader", None)
    with pytest.raises(RuntimeError, match=r"TextToImage\(autoencoder=\) got the directory .*PretrainedAutoencoder.load"):
        TextToImage(backbone, variables, objective.process, (4, 4, 4), autoencoder=str(VAE))


def test_a_run_of_another_kind_is_refused_before_reading_weights(tmp_path):
    from dew.config import ObjectiveConfig, RunConfig

    model = CausalTransformer(vocab_size=16, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, max_seq_len=16)
    RunConfig(model=ModelConfig.from_model(model),
              objective=ObjectiveConfig.from_objective(LMObjective(model, seq_len=8))).save(tmp_path / "lm")
    # no checkpoint was written: the kind is refused from run.json alone
    with pytest.raises(ValueError, match="is a LMObjective run, not a diffusion run"):
        TextToImage.from_run(tmp_path / "lm")
    with pytest.raises(FileNotFoundError, match="holds no run.json"):
        TextToImage.from_run(tmp_path)
