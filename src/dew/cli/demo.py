"""`dew demo`: the main job on an embedded default, needing no data or downloads.

It fits a small MLP to a curve the package generates, with checkpoints and a local tracker, then
prints what the model learned beside the truth.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def curve(x):
    """The function the demo learns."""
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


def run(out: str = "runs/demo", steps: int = 600, fresh: bool = True) -> None:
    """Train the demo model and print what it learned.

    Args:
        out: directory for the run's checkpoints, scalar journal and plots.
        steps: training steps.
        fresh: start over, deleting an earlier demo run in `out`.
    """
    import jax.numpy as jnp
    import numpy as np

    out_path = Path(out)
    if fresh and out_path.exists():
        shutil.rmtree(out_path)
    print(f"Fitting an MLP to y = sin(3x) + x/2 on [-1, 1] ({steps} steps); run files in {out_path}/")
    objective, state = fit_curve(out_path, steps=steps)
    probe = np.linspace(-1, 1, 9, dtype=np.float32).reshape(-1, 1)
    predicted = np.asarray(objective.model.apply(state.averaged, jnp.asarray(probe)))
    print("\n     x    truth  learned")
    for xi, yi, pi in zip(probe[:, 0], curve(probe)[:, 0], predicted[:, 0]):
        print(f"{xi:+6.2f}  {yi:+7.3f}  {pi:+7.3f}")
    worst = float(np.max(np.abs(predicted - curve(probe))))
    print(f"\nlargest error on these points: {worst:.3f}")
    print(f"plots: {out_path / 'tracking' / 'plots'}   checkpoint: {out_path / 'checkpoints'}")
