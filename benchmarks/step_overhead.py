"""Per-step overhead of `Trainer.fit` against a hand-written `jax.jit` loop on the same batches.

Both train the same MLP with the same Adam on the same pre-generated batches, in one process, so
machine noise hits both. The hand loop is the best case: a donated jitted step, `device_put` of each
batch, and one sync at the end. Compilation is excluded (each side runs once before timing), and the
figure is the median of several timed runs. Prints one JSON line.

    .venv/bin/python benchmarks/step_overhead.py [--steps 300] [--repeats 5] [--width 512]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Aux, Dataset, Field, InputSpec, Objective, Trainer


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


class Fit(Objective):
    def __init__(self, width: int, features: int):
        self.model = MLP(width)
        self.features = features
        self.inputs = InputSpec(Field("x", (features,)), Field("y", (1,)))

    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, self.features)))

    def loss(self, variables, batch, step):
        error = self.model.apply(variables, batch["x"]) - batch["y"]
        return jnp.mean(error**2), Aux()


def make_batches(count: int, batch: int, features: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        x = rng.normal(size=(batch, features)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x[:, :1]).astype(np.float32)})
    return out


def time_trainer(objective, optimizer, batches, steps: int) -> float:
    data = Dataset(train=lambda partition: itertools.cycle(batches), records=len(batches), batch=len(batches[0]["x"]))
    trainer = Trainer(objective, optimizer, key=jax.random.key(0))
    trainer.fit(data, steps=2, log_every=1000)  # compile
    start = time.perf_counter()
    state = trainer.fit(data, steps=steps, log_every=steps)
    jax.block_until_ready(state)
    return steps / (time.perf_counter() - start)


def time_hand_loop(objective, optimizer, batches, steps: int) -> float:
    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return objective.loss({"params": p}, batch, None)[0]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    fresh = lambda: objective.init(jax.random.key(0))["params"]  # noqa: E731
    params = fresh()
    opt_state = optimizer.init(params)
    params, opt_state, _ = step(params, opt_state, jax.device_put(batches[0]))  # compile
    jax.block_until_ready(params)
    params = fresh()
    opt_state = optimizer.init(params)
    start = time.perf_counter()
    for batch in itertools.islice(itertools.cycle(batches), steps):
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch))
    jax.block_until_ready((params, loss))
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--features", type=int, default=64)
    args = parser.parse_args()

    objective = Fit(args.width, args.features)
    optimizer = optax.adam(1e-3)
    batches = make_batches(16, args.batch, args.features)
    dew_rates, hand_rates = [], []
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both
        hand_rates.append(time_hand_loop(objective, optimizer, batches, args.steps))
        dew_rates.append(time_trainer(objective, optimizer, batches, args.steps))
    dew, hand = statistics.median(dew_rates), statistics.median(hand_rates)
    print(
        json.dumps(
            {
                "benchmark": "step_overhead",
                "work": f"MLP 2x{args.width}, batch {args.batch}x{args.features}, adam, {args.steps} steps",
                "dew_steps_per_s": round(dew, 2),
                "hand_jit_steps_per_s": round(hand, 2),
                "dew_over_hand": round(dew / hand, 4),
                "goal": "dew_over_hand >= 0.95",
                "hardware": f"{jax.devices()[0].device_kind} x{jax.device_count()}, {platform.processor() or platform.machine()}",
                "jax": jax.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
