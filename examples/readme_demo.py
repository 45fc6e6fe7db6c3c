"""A tour of Dew offline: a language model, resuming it, DPO on top of it, and flow matching.

1. Language modelling: a byte-level decoder learns the text of Python's help topics
   (`pydoc_data.topics`, which every Python install carries; the same corpus `dew demo` reads).
2. Resuming: a rebuilt Trainer given the same `Checkpoints` directory picks up at the saved step
   and trains on to an absolute step target, then samples a continuation of a prompt.
3. DPO: the trained decoder, as its own frozen reference, learns to prefer a corpus passage's real
   continuation over the same words shuffled; the implicit reward margin is scored on held-out pairs
   before and after.
4. Flow matching: an MLP learns the velocity field that carries Gaussian noise to a ring of eight
   Gaussians (`Flow`, rectified flow); samples drawn with Euler steps are compared with the data and
   with samples from the untrained network.

Everything it writes goes under --out (tokens, checkpoints, the drawn points); the checkpoints of an
earlier run in the same folder are deleted first, so the resume starts from this run's checkpoint.

    python examples/readme_demo.py                 # a few minutes on 2 CPU cores
    python examples/readme_demo.py --smoke         # tiny sizes and few steps, seconds a part
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Checkpoints, Dataset, Evaluation, Field, InputSpec, Trainer, sample
from dew.data import ByteTokenizer, Loading, PreferencePairs, TokenCorpus, TokenWindows, tokenize
from dew.data.corpora import help_topics_text
from dew.diffusion.presets import Flow
from dew.nn.backbones import CausalTransformer
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.lm import LMObjective, Perplexity
from dew.objectives.rl import DPOObjective
from dew.sampling import Euler, Sampling

UNIFORM_BYTE_LOSS = math.log(256)  # nats per byte of a model that knows nothing


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big and how long each part is; `--smoke` swaps in `SMOKE`."""

    width: int = 128
    layers: int = 2
    seq_len: int = 64
    batch: int = 16
    lm_steps: int = 500           # the first run, which leaves a checkpoint
    resumed_steps: int = 800      # the absolute target the rebuilt trainer trains to
    dpo_pairs: int = 256
    dpo_steps: int = 60
    dpo_learning_rate: float = 3e-4
    flow_steps: int = 3000
    flow_samples: int = 2000
    solver_steps: int = 50


SMOKE = Sizes(width=32, layers=1, batch=8, lm_steps=16, resumed_steps=24, dpo_pairs=64, dpo_steps=24,
              dpo_learning_rate=2e-3, flow_steps=300, flow_samples=500, solver_steps=16)


def first_and_last(history, name: str, window: int) -> tuple[float, float]:
    """The mean of metric `name` over the first and over the last `window` steps of `Trainer.history`."""
    values = [row[name] for row in history]
    return float(np.mean(values[:window])), float(np.mean(values[-window:]))


# ----------------------------------------------------------------------------------------------
# 1 and 2: a byte-level decoder, trained, stopped and resumed


def decoder(sizes: Sizes) -> CausalTransformer:
    return CausalTransformer(vocab_size=256, emb_features=sizes.width, num_layers=sizes.layers,
                             num_heads=4, num_kv_heads=2, mlp_features=3 * sizes.width,
                             max_seq_len=4 * sizes.seq_len, dtype=jnp.float32)


def lm_optimizer(sizes: Sizes):
    """AdamW with warm-up and cosine decay over the whole run (both trainers build the same one)."""
    total = sizes.resumed_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, max(total // 10, 1), total, end_value=2e-4)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.1))


def language_model(out: Path, sizes: Sizes) -> dict:
    print(f"\n== 1. language model: a byte-level decoder on Python's help topics ({sizes.lm_steps} steps)")
    corpus_file = out / "corpus.txt"
    corpus_file.write_text(help_topics_text(), encoding="utf-8")
    corpus = tokenize(corpus_file, out / "tokens", "byte", val_fraction=0.05)
    data = TokenWindows(path=str(out / "tokens"), seq_len=sizes.seq_len, loading=Loading(workers=0))
    objective = LMObjective(decoder(sizes), seq_len=sizes.seq_len, tokenizer=ByteTokenizer())
    checkpoints = Checkpoints(out / "checkpoints", keep=2)
    trainer = Trainer(objective, lm_optimizer(sizes), key=jax.random.key(0), checkpoints=checkpoints)
    trainer.fit(data.load(batch=sizes.batch), steps=sizes.lm_steps, log_every=max(sizes.lm_steps // 5, 1),
                checkpoint_every=sizes.lm_steps, eval_every=sizes.lm_steps, metrics=(Perplexity(),))
    checkpoints.wait()
    window = max(sizes.lm_steps // 10, 1)
    first, last = first_and_last(trainer.history, "loss", window)
    scores = trainer.evaluations[-1].scores
    print(f"training loss {first:.3f} -> {last:.3f} nats/byte (mean of the first and last {window} steps; "
          f"uniform over bytes is {UNIFORM_BYTE_LOSS:.3f})")
    print(f"validation loss {scores['val/loss']:.3f}, perplexity {scores['val/perplexity']:.2f}; "
          f"{corpus.meta['train_tokens']} training bytes")
    print(f"checkpoints in {checkpoints.directory}: steps {checkpoints.steps()}")
    return {"first_loss": first, "last_loss": last, "val_loss": scores["val/loss"],
            "checkpoint_steps": checkpoints.steps()}


def resume(out: Path, sizes: Sizes) -> tuple[dict, CausalTransformer, dict]:
    print(f"\n== 2. resume: a rebuilt Trainer with the same Checkpoints trains on to step {sizes.resumed_steps}")
    # Everything is built anew, as a second run of the script would: only the directory is shared.
    data = TokenWindows(path=str(out / "tokens"), seq_len=sizes.seq_len, loading=Loading(workers=0))
    objective = LMObjective(decoder(sizes), seq_len=sizes.seq_len, tokenizer=ByteTokenizer())
    checkpoints = Checkpoints(out / "checkpoints", keep=2)
    restored_from = checkpoints.steps()[-1]
    trainer = Trainer(objective, lm_optimizer(sizes), key=jax.random.key(0), checkpoints=checkpoints)
    state = trainer.fit(data.load(batch=sizes.batch), steps=sizes.resumed_steps,
                        log_every=max((sizes.resumed_steps - restored_from) // 3, 1),
                        checkpoint_every=sizes.resumed_steps)
    checkpoints.wait()
    first_step = trainer.history[0]["step"]
    print(f"restored step {restored_from}; this trainer ran steps {first_step}..{int(state.step)} "
          f"(its first loss {trainer.history[0]['loss']:.3f}, not the {UNIFORM_BYTE_LOSS:.2f} of a fresh model)")
    print(f"checkpoints now: steps {checkpoints.steps()}")

    prompt = "The return statement"
    task = objective.policy(state.variables, Sampling(temperature=0.8, top_k=40))
    continuation = task.decode(task([prompt], 120, seed=0))[0]
    print(f"a sampled continuation of {prompt!r} (temperature 0.8, top-k 40):\n  {prompt + continuation!r}")
    result = {"restored_from": restored_from, "first_step": first_step, "final_step": int(state.step),
              "first_resumed_loss": trainer.history[0]["loss"], "continuation": continuation,
              "checkpoint_steps": checkpoints.steps()}
    return result, objective.model, state.variables


# ----------------------------------------------------------------------------------------------
# 3: DPO from the trained decoder


def shuffled_words(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """The same bytes with the space-separated words in another order (None if it cannot differ)."""
    words = bytes(ids.tolist()).split(b" ")
    if len(set(words)) < 3:
        return None
    order = rng.permutation(len(words))
    while np.array_equal(order, np.arange(len(words))):
        order = rng.permutation(len(words))
    shuffled = b" ".join(words[i] for i in order)
    return None if shuffled == bytes(ids.tolist()) else np.frombuffer(shuffled, np.uint8).astype(np.int32)


def preference_records(ids: np.ndarray, count: int, width: int, seed: int) -> list[dict]:
    """Pairs of rows `width` ids wide: a passage's first half, then its real second half (chosen)
    or the second half's words shuffled (rejected); the masks mark the second halves."""
    rng = np.random.default_rng(seed)
    prompt_len = width // 2
    records = []
    while len(records) < count:
        start = int(rng.integers(0, len(ids) - width))
        prompt, response = ids[start:start + prompt_len], np.asarray(ids[start + prompt_len:start + width])
        rejected = shuffled_words(response, rng)
        if rejected is None:
            continue
        mask = [0] * prompt_len + [1] * len(response)
        records.append({"chosen": np.concatenate([prompt, response]).tolist(), "chosen_mask": mask,
                        "rejected": np.concatenate([prompt, rejected]).tolist(), "rejected_mask": mask})
    return records


def dpo(out: Path, sizes: Sizes, model: CausalTransformer, weights: dict) -> dict:
    print(f"\n== 3. DPO: prefer a passage's real continuation to its words shuffled ({sizes.dpo_steps} steps)")
    corpus = TokenCorpus.read(out / "tokens")  # the bytes part 1 wrote, as memory maps
    width = sizes.seq_len + 1  # DPOObjective(seq_len) scores rows of seq_len + 1 ids
    train = PreferencePairs(preference_records(corpus.train, sizes.dpo_pairs, width, seed=0), seq_len=width)
    held_out = PreferencePairs(preference_records(corpus.val, 64, width, seed=1), seq_len=width)
    data = Dataset.from_records(train.columns(), batch=sizes.batch, seed=0, validation=held_out.columns())

    objective = DPOObjective(model, sizes.seq_len, beta=0.1, variables=weights, tokenizer=ByteTokenizer())
    before = Evaluation.run(objective, objective.init(jax.random.key(0), weights), data.val,
                            key=jax.random.key(0)).scores
    trainer = Trainer(objective, optax.adam(sizes.dpo_learning_rate), key=jax.random.key(1))
    trainer.fit(data, steps=sizes.dpo_steps, log_every=max(sizes.dpo_steps // 4, 1), eval_every=sizes.dpo_steps)
    after = trainer.evaluations[-1].scores
    window = max(sizes.dpo_steps // 5, 1)
    first, last = first_and_last(trainer.history, "reward_margin", window)
    print(f"training reward margin {first:+.3f} -> {last:+.3f} (mean of the first and last {window} steps)")
    print(f"held-out pairs before: reward margin {before['val/reward_margin']:+.3f} (the policy is its own reference)")
    print(f"held-out pairs after:  reward margin {after['val/reward_margin']:+.3f}, the real continuation "
          f"preferred in {after['val/reward_accuracy']:.0%} of them")
    return {"train_margin_first": first, "train_margin_last": last,
            "held_out_margin_before": before["val/reward_margin"], "held_out_margin_after": after["val/reward_margin"],
            "held_out_accuracy_after": after["val/reward_accuracy"]}


# ----------------------------------------------------------------------------------------------
# 4: flow matching on a 2-D toy distribution

RING_MODES, RING_RADIUS, RING_SPREAD = 8, 0.75, 0.05


def ring_centers() -> np.ndarray:
    angles = 2 * np.pi * np.arange(RING_MODES) / RING_MODES
    return RING_RADIUS * np.stack([np.cos(angles), np.sin(angles)], axis=1)


def ring_of_gaussians(count: int, seed: int) -> np.ndarray:
    """`count` points from eight Gaussians (std RING_SPREAD) evenly spaced on a circle, float32 [count, 2]."""
    rng = np.random.default_rng(seed)
    centers = ring_centers()[rng.integers(0, RING_MODES, count)]
    return (centers + RING_SPREAD * rng.standard_normal((count, 2))).astype(np.float32)


def ring_statistics(points: np.ndarray) -> dict:
    """How ring-like `points` are: distance to the nearest center, the share within three standard
    deviations of one, how many of the eight modes hold at least 5% of the points, radius."""
    distances = np.linalg.norm(points[:, None, :] - ring_centers()[None], axis=-1)
    nearest = distances.argmin(axis=1)
    shares = np.bincount(nearest, minlength=RING_MODES) / len(points)
    radius = np.linalg.norm(points, axis=1)
    return {"nearest_center": float(distances.min(axis=1).mean()),
            "near_a_mode": float(np.mean(distances.min(axis=1) < 3 * RING_SPREAD)),
            "modes_covered": int(np.sum(shares >= 0.05)),
            "radius_mean": float(radius.mean()), "radius_std": float(radius.std())}


class VelocityMLP(nn.Module):
    """v(x_t, t): the flow's velocity at a point and time; t enters as sine and cosine features."""

    width: int = 128
    depth: int = 3
    frequencies: int = 8

    @nn.compact
    def __call__(self, x, t, conditions=None):
        angles = t[:, None] * (2.0 ** jnp.arange(self.frequencies)) * jnp.pi
        h = jnp.concatenate([x, jnp.sin(angles), jnp.cos(angles)], axis=-1)
        for _ in range(self.depth):
            h = nn.silu(nn.Dense(self.width)(h))
        return nn.Dense(x.shape[-1])(h)


def flow_matching(out: Path, sizes: Sizes) -> dict:
    print(f"\n== 4. flow matching: an MLP carries noise to a ring of eight Gaussians ({sizes.flow_steps} steps)")
    data = Dataset.from_records({"point": ring_of_gaussians(8192, seed=0)}, batch=256, seed=0)
    objective = DiffusionObjective(VelocityMLP(), Flow(), InputSpec(Field("point", (2,))), ema_decay=None,
                                   unconditional_prob=0.0)
    schedule = optax.cosine_decay_schedule(5e-3, sizes.flow_steps, alpha=0.05)
    trainer = Trainer(objective, optax.adam(schedule), key=jax.random.key(2))
    state = trainer.fit(data, steps=sizes.flow_steps, log_every=max(sizes.flow_steps // 5, 1))

    def draw(variables):
        denoise = objective.process.denoiser(objective.model, variables)
        noise = objective.process.noise(jax.random.key(3), (sizes.flow_samples, 2))
        return np.asarray(sample(denoise, noise, solver=Euler(), steps=sizes.solver_steps))

    drawn = draw(state.variables)
    untrained = draw(objective.init(jax.random.key(4)))
    np.save(out / "samples.npy", drawn)
    window = max(sizes.flow_steps // 10, 1)
    first, last = first_and_last(trainer.history, "loss", window)
    print(f"training loss {first:.3f} -> {last:.3f} (mean of the first and last {window} steps)")
    rows = {"data": ring_statistics(ring_of_gaussians(sizes.flow_samples, seed=5)),
            "trained": ring_statistics(drawn), "untrained": ring_statistics(untrained)}
    print(f"{sizes.flow_samples} points each, {sizes.solver_steps} Euler steps; samples saved to {out / 'samples.npy'}")
    print(f"{'':10s} {'nearest center':>14s} {'near a mode':>11s} {'modes':>5s} {'radius':>13s}")
    for name, row in rows.items():
        print(f"{name:10s} {row['nearest_center']:14.3f} {row['near_a_mode']:11.0%} {row['modes_covered']:5d} "
              f"{row['radius_mean']:7.3f} ±{row['radius_std']:.3f}")
    return {"first_loss": first, "last_loss": last, **rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/readme_demo", help="where everything is written")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and few steps, to check it runs")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else Sizes()

    out = Path(args.out)
    shutil.rmtree(out / "lm" / "checkpoints", ignore_errors=True)  # the resume must find this run's step
    for part in ("lm", "flow"):
        (out / part).mkdir(parents=True, exist_ok=True)
    marks = [time.perf_counter()]
    results = {"lm": language_model(out / "lm", sizes)}
    marks.append(time.perf_counter())
    results["resume"], model, weights = resume(out / "lm", sizes)
    marks.append(time.perf_counter())
    results["dpo"] = dpo(out / "lm", sizes, model, weights)
    marks.append(time.perf_counter())
    results["flow"] = flow_matching(out / "flow", sizes)
    marks.append(time.perf_counter())
    print("\nseconds per part: " + ", ".join(f"{part} {seconds:.0f}" for part, seconds in zip(results, np.diff(marks))))
    return results


if __name__ == "__main__":
    main()
