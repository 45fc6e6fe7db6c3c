"""`dew demo`: the main job on an embedded default, needing no data or downloads.

The language-model part trains a small decoder on a corpus every Python install carries (the text
of `pydoc_data.topics`, about 460 KB of English from Python's reference manual), saves the run,
reloads it with `dew.pipeline` and prints a greedy continuation. The curve part fits an MLP to a
function the package generates and prints what it learned beside the truth.
"""

from __future__ import annotations

import shutil
from pathlib import Path

PARTS = ("lm", "digits", "curve")


def train_decoder(out: Path, steps: int = 1500, seed: int = 0, log_every: int | None = None):
    """Train a byte-level decoder on `help_topics_text()`; the run (run.json + checkpoint) goes in out/run."""
    import jax
    import jax.numpy as jnp

    from dew import Checkpoints, LocalTracker, Trainer
    from dew.config import ModelConfig, ObjectiveConfig, OptimConfig, RunConfig, TrainerConfig
    from dew.data import Loading, TokenWindows, tokenize
    from dew.data.corpora import help_topics_text
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.lm import LMObjective, Perplexity
    from dew.sampling import Sampling

    seq_len, batch = 64, 16
    corpus_file = out / "corpus.txt"
    corpus_file.write_text(help_topics_text(), encoding="utf-8")
    tokenize(corpus_file, out / "tokens", "byte", val_fraction=0.02)
    data = TokenWindows(path=str(out / "tokens"), seq_len=seq_len, seed=seed, loading=Loading(workers=0))
    model = CausalTransformer(
        vocab_size=256, emb_features=128, num_layers=4, num_heads=4, num_kv_heads=2,
        mlp_features=384, max_seq_len=seq_len * 4, dtype=jnp.float32,
    )
    objective = LMObjective(model, seq_len=seq_len)
    optim = OptimConfig(optimizer="adamw", learning_rate=2e-3, weight_decay=0.1, b2=0.99,
                        warmup_steps=100, decay_steps=steps, clip_norm=1.0)
    run = out / "run"
    config = RunConfig(
        model=ModelConfig.from_model(model),
        data=data,
        optim=optim,
        trainer=TrainerConfig(name="demo-lm", checkpoint_dir=str(run), steps=steps, batch_size=batch,
                              checkpoint_every=steps, keep=1, seed=seed),
        objective=ObjectiveConfig.from_objective(objective),
        sampling=Sampling(temperature=0.0),
    )
    config.save(run, tokenizer="byte")
    checkpoints = Checkpoints(run, keep=1)
    every = log_every or max(steps // 6, 1)
    with LocalTracker(run / "tracking", plots=True) as tracker:
        trainer = Trainer(objective, optim.build(), key=jax.random.key(seed), checkpoints=checkpoints,
                          tracker=tracker)
        state = trainer.fit(data.load(batch=batch), steps=steps, log_every=every, eval_every=steps,
                            checkpoint_every=steps, metrics=(Perplexity(),))
    checkpoints.wait()
    return run, trainer, state


def lm_part(out: Path, steps: int) -> None:
    import jax

    import dew

    print(f"== language model: a byte-level decoder on Python's help topics ({steps} steps)")
    run, trainer, _ = train_decoder(out, steps=steps)
    scores = trainer.evaluations[-1].scores
    task = dew.pipeline(run, ema=False)  # rebuilt from run.json and the checkpoint alone (no EMA kept)
    prompt = "The return statement"
    drawn = task([prompt], 100, key=jax.random.key(0))
    print(f"\nvalidation loss {scores['val/loss']:.3f} nats/byte, perplexity {scores['val/perplexity']:.2f}")
    print(f"run saved in {run}/ (run.json, checkpoint, tracking/plots)")
    print(f"\ngreedy continuation of {prompt!r}:\n")
    print(prompt + drawn.text[0])
    print()


def train_digits(out: Path, steps: int = 1500, seed: int = 0, log_every: int | None = None):
    """A class-conditional DiT on scikit-learn's 8x8 digits (2x2 patches); returns (objective, state)."""
    import jax
    import optax

    from dew import Checkpoints, Field, InputSpec, LocalTracker, Trainer
    from dew.data import Digits, Loading
    from dew.diffusion.presets import EDM
    from dew.nn.backbones import SimpleDiT
    from dew.objectives.diffusion import DiffusionObjective

    data = Digits(image_size=8, val_fraction=0.1, seed=seed, loading=Loading(workers=0)).load(batch=64)
    model = SimpleDiT(patch_size=2, emb_features=128, num_layers=4, num_heads=4, num_classes=10)
    objective = DiffusionObjective(
        model, EDM(regime="pixel"),
        InputSpec(Field("image", (8, 8, 1)), conditions={"label": Field("label", ())}),
        ema_decay=0.995, unconditional_prob=0.1, preview_count=20, preview_steps=24,
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, min(100, steps // 10), steps, end_value=1e-4)
    checkpoints = Checkpoints(out / "checkpoints", keep=1)
    with LocalTracker(out / "tracking", plots=True) as tracker:
        trainer = Trainer(objective, optax.adamw(schedule, weight_decay=0.0), key=jax.random.key(seed),
                          checkpoints=checkpoints, tracker=tracker)
        state = trainer.fit(data, steps=steps, log_every=log_every or max(steps // 6, 1),
                            checkpoint_every=steps)
    checkpoints.wait()
    return objective, state


def digits_part(out: Path, steps: int, sample_steps: int = 32) -> None:
    import jax
    import numpy as np

    from dew.eval.image_metrics import save_image_grid
    from dew.sampling import CFG, Heun

    print(f"== diffusion: a class-conditional DiT on scikit-learn's digits, EDM ({steps} steps)")
    objective, state = train_digits(out, steps=steps)
    task = objective.pipeline(state)
    labels = [digit for digit in range(10) for _ in range(4)]
    drawn = task(labels, steps=sample_steps, solver=Heun(), guidance=CFG(2.0), key=jax.random.key(1)).host()
    images = drawn.uint8().reshape(10, 4, 8, 8, 1).transpose(1, 0, 2, 3, 4).reshape(40, 8, 8, 1)
    images = images.repeat(4, axis=1).repeat(4, axis=2)  # 32x32 pixels per digit, to be seen
    path = save_image_grid(images, out / "samples.png", rows=4, padding=2)
    print(f"\nsamples.png: each column is one digit, 0 to 9, drawn with classifier-free guidance -> {path}")
    print("digit means (mean pixel of each class's 4 samples):",
          " ".join(f"{d}:{float(np.mean(drawn.uint8()[4 * d:4 * d + 4])):.0f}" for d in range(10)))
    print()


def curve(x):
    """The function the curve part learns."""
    import numpy as np

    return np.sin(3 * x) + 0.5 * x


def fit_curve(out: Path, steps: int = 600, seed: int = 0):
    """Fit an MLP to `curve` on [-1, 1]; returns (objective, state)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew import Aux, Checkpoints, Dataset, Field, InputSpec, LocalTracker, Objective, Trainer

    class MLP(nn.Module):
        width: int = 64

        @nn.compact
        def __call__(self, x):
            x = nn.tanh(nn.Dense(self.width)(x))
            x = nn.tanh(nn.Dense(self.width)(x))
            return nn.Dense(1)(x)

    class CurveFit(Objective):
        model = MLP()
        inputs = InputSpec(Field("x", (1,)), Field("y", (1,)))
        ema_decay = 0.99

        def init(self, key, variables=None):
            return variables if variables is not None else self.model.init(key, jnp.zeros((1, 1)))

        def loss(self, variables, batch, step):
            error = self.model.apply(variables, batch["x"]) - batch["y"]
            mse = jnp.mean(error**2)
            return mse, Aux(metrics={"rmse": jnp.sqrt(mse)})

    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(2048, 1)).astype(np.float32)
    x_val = np.linspace(-1, 1, 256, dtype=np.float32).reshape(-1, 1)
    data = Dataset.from_records(
        {"x": x, "y": curve(x)}, batch=64, seed=seed, validation={"x": x_val, "y": curve(x_val)}
    )
    objective = CurveFit()
    checkpoints = Checkpoints(out / "checkpoints", keep=1)
    with LocalTracker(out / "tracking", plots=True) as tracker:
        trainer = Trainer(
            objective,
            optax.adam(optax.cosine_decay_schedule(1e-2, steps)),
            key=jax.random.key(seed),
            checkpoints=checkpoints,
            tracker=tracker,
        )
        state = trainer.fit(
            data, steps=steps, log_every=steps // 4, eval_every=steps // 2, checkpoint_every=steps
        )
        checkpoints.wait()
    return objective, state


def curve_part(out: Path, steps: int) -> None:
    import jax.numpy as jnp
    import numpy as np

    print(f"== curve: an MLP fits y = sin(3x) + x/2 on [-1, 1] ({steps} steps)")
    objective, state = fit_curve(out, steps=steps)
    probe = np.linspace(-1, 1, 9, dtype=np.float32).reshape(-1, 1)
    predicted = np.asarray(objective.model.apply(state.averaged, jnp.asarray(probe)))
    print("\n     x    truth  learned")
    for xi, yi, pi in zip(probe[:, 0], curve(probe)[:, 0], predicted[:, 0]):
        print(f"{xi:+6.2f}  {yi:+7.3f}  {pi:+7.3f}")
    worst = float(np.max(np.abs(predicted - curve(probe))))
    print(f"\nlargest error on these points: {worst:.3f}")
    print(f"plots: {out / 'tracking' / 'plots'}   checkpoint: {out / 'checkpoints'}\n")


def run(
    out: str = "runs/demo",
    parts: tuple[str, ...] = ("lm", "digits"),
    lm_steps: int = 1500,
    digits_steps: int = 1500,
    digits_sample_steps: int = 32,
    curve_steps: int = 600,
    fresh: bool = True,
) -> None:
    """Run the main job on an embedded default: a small decoder trained on Python's help text
    (a saved run and a greedy continuation) and a class-conditional DiT on scikit-learn's digits
    (runs/demo/digits/samples.png).

    Args:
        out: The folder for the runs; each part writes into its own subfolder.
        parts: Which parts to run: lm, digits, curve.
        lm_steps: Training steps of the decoder.
        digits_steps: Training steps of the digits DiT.
        digits_sample_steps: Heun steps of each sample in the digits grid.
        curve_steps: Training steps of the curve MLP.
        fresh: Start over, deleting an earlier run of the same part.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"Unknown demo part(s) {unknown}; choose from {PARTS}.")
    out_path = Path(out)
    for part in parts:
        folder = out_path / part
        if fresh and folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if part == "lm":
            lm_part(folder, lm_steps)
        elif part == "digits":
            digits_part(folder, digits_steps, digits_sample_steps)
        else:
            curve_part(folder, curve_steps)
