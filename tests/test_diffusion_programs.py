"""The spec's diffusion programs on local data, and class-conditional sampling judged by a classifier."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Field, InputSpec, Trainer, sample
from dew.data import Digits, Loading
from dew.diffusion.presets import EDM
from dew.nn.backbones import SimpleDiT
from dew.objectives.diffusion import DiffusionObjective
from dew.sampling import Heun


def test_getting_started_program_runs_on_digits(tmp_path, monkeypatch):
    """The Flowers program with the data swapped for digits and the sizes shrunk for a CPU."""
    monkeypatch.chdir(tmp_path)

    def train():
        data = Digits(image_size=16, channels=3, val_fraction=0.1,
                      loading=Loading(workers=0, threads=2, read_buffer=16, worker_buffer=2)).load(batch=16)
        model = SimpleDiT(patch_size=4, emb_features=32, num_layers=1, num_heads=2, dtype=jnp.bfloat16,
                          attention_impl="auto")
        objective = DiffusionObjective(model, EDM(regime="pixel"), InputSpec(Field("image", (16, 16, 3))))
        trainer = Trainer(objective, optax.adamw(2e-4), key=jax.random.key(0),
                          checkpoints=Checkpoints("runs/digits16/checkpoints"))
        return objective, model, trainer.fit(data, steps=4, log_every=2, checkpoint_every=2)

    objective, model, state = train()
    process = objective.process
    denoise = process.denoiser(model, state.averaged, conditions={})
    images = sample(denoise, process.noise(jax.random.key(1), (8, 16, 16, 3)), solver=Heun(), steps=40,
                    key=jax.random.key(2))
    assert images.shape == (8, 16, 16, 3) and bool(jnp.all(jnp.isfinite(images)))
    assert state.params["patch_embed"]["proj"]["kernel"].dtype == jnp.float32  # fp32 master weights
    assert Checkpoints("runs/digits16/checkpoints").steps() == [2, 4]


def digit_classifier():
    from sklearn.linear_model import LogisticRegression

    images, labels = Digits(image_size=8).arrays()
    return LogisticRegression(max_iter=2000).fit(images.reshape(len(images), -1) / 255.0, labels)


@pytest.mark.slow
def test_guided_samples_are_classified_as_the_requested_digit(tmp_path):
    from dew.cli.demo import train_digits
    from dew.sampling import CFG

    objective, state = train_digits(tmp_path, steps=1500)
    labels = np.repeat(np.arange(10), 10)
    drawn = objective.pipeline(state)(list(labels), steps=32, solver=Heun(), guidance=CFG(2.0),
                                     key=jax.random.key(0)).host()
    predicted = digit_classifier().predict(drawn.uint8().reshape(100, -1) / 255.0)
    accuracy = float(np.mean(predicted == labels))
    assert accuracy > 0.6, accuracy  # chance is 0.1
