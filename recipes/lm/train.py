"""Train a decoder language model on a text file and save it as a run that `dew.pipeline` reloads.

    python recipes/lm/train.py --help
    python recipes/lm/train.py                                   # Python's help topics, byte tokens
    python recipes/lm/train.py --data.text corpus.txt --optim.learning-rate 3e-4 --trainer.steps 5000
    python recipes/lm/train.py --config runs/lm/recipe.json --trainer.steps 8000   # continue longer

The text is tokenized into `<run>/tokens` (once; a rerun reuses it), the run trains with
`RunConfig.train` in `<trainer.checkpoint-dir>/<trainer.name>` beside its run.json, recipe.json and
tracking journal, and the script ends by reloading the run and printing a continuation of `--prompt`.
Without `--data.text` it reads the text of Python's help topics, so it needs no download.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Literal

from dew.config import ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dew.config.command_line import parse, save_recipe
from dew.config.train import run_directory


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The decoder (a CausalTransformer); the vocabulary size comes from the tokenizer."""

    emb_features: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: one per query head)."""
    mlp_features: int = 384
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; the weights stay float32."""


@dataclasses.dataclass(frozen=True)
class Text:
    """The training text and how it becomes rows of tokens."""

    text: str | None = None
    """A UTF-8 text file; None reads the text of Python's help topics (offline)."""
    tokenizer: str = "byte"
    """'byte', or a tokenizer.json, a directory holding one, or a Hub id already in the local cache."""
    seq_len: int = 64
    """Tokens per training row (the model sees seq_len and predicts the next of each)."""
    val_fraction: float = 0.02
    """Share of the text held out for validation perplexity."""
    seed: int = 0
    """Draws the window order of each epoch."""


@dataclasses.dataclass(frozen=True)
class LMRecipe:
    """Train a decoder language model and save it as a run."""

    model: Decoder = Decoder()
    data: Text = Text()
    optim: OptimConfig = OptimConfig(optimizer="adamw", learning_rate=2e-3, weight_decay=0.1, b2=0.99,
                                     warmup_steps=100, clip_norm=1.0)
    trainer: TrainerConfig = TrainerConfig(name="lm", checkpoint_dir="runs", steps=1500, batch_size=16,
                                           log_every=100, eval_every=500, checkpoint_every=500, keep=1)
    ema_decay: float | None = None
    """Keep an averaged copy of the weights with this decay (None keeps none)."""
    temperature: float = 0.0
    """The sampling temperature the run records for generation (0 is greedy)."""
    prompt: str = "The return statement"
    """Printed with its continuation from the reloaded run at the end."""
    new_tokens: int = 64
    """Tokens generated after the prompt."""


def main(recipe: LMRecipe) -> Path:
    recipe.trainer.apply_xla_flags()  # before anything starts JAX's backend

    import jax.numpy as jnp

    import dew
    from dew.data import TokenWindows, load_tokenizer, tokenize
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.lm import LMObjective, Perplexity
    from dew.sampling import Sampling

    run = run_directory(recipe.trainer, recipe.trainer.name)
    run.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, run)
    tokens = run / "tokens"
    if not (tokens / "meta.json").is_file():
        source = Path(recipe.data.text) if recipe.data.text else _help_topics(run)
        tokenize(source, tokens, recipe.data.tokenizer, val_fraction=recipe.data.val_fraction)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    data = TokenWindows(path=str(tokens), seq_len=recipe.data.seq_len, seed=recipe.data.seed)

    shape = recipe.model
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=shape.emb_features,
                              num_layers=shape.num_layers, num_heads=shape.num_heads,
                              num_kv_heads=shape.num_kv_heads, mlp_features=shape.mlp_features,
                              max_seq_len=recipe.data.seq_len * 4, dtype=jnp.dtype(shape.dtype))
    objective = LMObjective(model, seq_len=recipe.data.seq_len, ema_decay=recipe.ema_decay, tokenizer=tokenizer)
    config = RunConfig(model=ModelConfig.from_model(model), data=data, optim=recipe.optim, trainer=recipe.trainer,
                       sampling=Sampling(temperature=recipe.temperature))
    metrics = (Perplexity(),) if recipe.trainer.eval_every is not None else ()
    state = config.train(objective, metrics=metrics, tokenizer=recipe.data.tokenizer)

    task = dew.pipeline(run, ema=recipe.ema_decay is not None)  # the run alone rebuilds the model
    continuation = task([recipe.prompt], recipe.new_tokens, seed=0).text[0]
    print(json.dumps({"run": str(run), "step": int(state.step), "prompt": recipe.prompt,
                      "continuation": continuation}))
    return run


def _help_topics(run: Path) -> Path:
    from dew.data.corpora import help_topics_text
    from dew.files import write_atomic

    return write_atomic(run / "corpus.txt", help_topics_text())


if __name__ == "__main__":
    main(parse(LMRecipe, sys.argv[1:]))
