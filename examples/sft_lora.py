"""LoRA supervised fine-tuning of a decoder checkpoint on chat data, exported as a PEFT adapter.

The base is a Hugging Face checkpoint directory (`--base`: any decoder Dew loads that carries a
tokenizer with a chat template). Without one, a tiny random Qwen3 with the test suite's small
tokenizer is written first, so the program runs offline. The conversations are made here: short
questions with fixed answers, rendered by the checkpoint's own chat template; only the assistant's
tokens are scored. The adapter (rank 8 on every projection but the head) trains while the base stays frozen, is
written as a PEFT adapter directory (`peft.PeftModel.from_pretrained(base_model, out/adapter)`
loads it), and the adapted model answers a training question.

    python examples/sft_lora.py --base path/to/checkpoint   # a real checkpoint
    python examples/sft_lora.py --smoke                      # a tiny run, seconds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
import optax

from dew import Checkpoints, Trainer
from dew.config.run import ModelConfig, ObjectiveConfig, RunConfig
from dew.data import ChatMessages, HFTokenizer
from dew.data.chat import Role
from dew.interop import Pretrained, PretrainedDecoder
from dew.nn.adapters import LoRA
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling

TOKENIZER = Path(__file__).resolve().parents[1] / "tests/fixtures/tokenizers/tiny-tools"
FACTS = [
    ("What color is the sky?", "Blue."), ("What is two plus two?", "Four."),
    ("Which animal barks?", "A dog."), ("What do bees make?", "Honey."),
    ("What is frozen water?", "Ice."), ("How many legs has a cat?", "Four."),
    ("What shines at night?", "The moon."), ("What falls from clouds?", "Rain."),
]


def conversations() -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FACTS]


def tiny_base(directory: Path) -> Path:
    """A small random Qwen3 checkpoint with a chat-template tokenizer, written as Hugging Face does."""
    tokenizer = HFTokenizer(TOKENIZER)
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=64, num_layers=2, num_heads=4,
                              num_kv_heads=2, mlp_features=128, max_seq_len=128, qk_norm=True, tie_embeddings=True)
    variables = model.init(jax.random.key(0), np.zeros((1, 8), np.int32))
    PretrainedDecoder.from_model(model, variables, tokenizer=tokenizer).save(directory, overwrite=True)
    return directory


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=None, help="a Hugging Face checkpoint directory")
    parser.add_argument("--out", type=Path, default=Path("runs/sft-lora"))
    parser.add_argument("--smoke", action="store_true", help="a tiny base and a few steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--seq-len", type=int, default=48)
    args = parser.parse_args(argv)
    steps = args.steps or (30 if args.smoke else 300)

    base = args.base or tiny_base(args.out / "base")
    pretrained = Pretrained.load(base)
    if pretrained.tokenizer is None:
        raise SystemExit(f"{base} holds no tokenizer.json; SFT needs the checkpoint's own tokenizer")
    adapted = pretrained.adapt(LoRA(rank=args.rank, alpha=2 * args.rank, modules="all-linear"), key=0)

    chats = ChatMessages(conversations(), pretrained.tokenizer, seq_len=args.seq_len)
    objective = LMObjective(adapted, seq_len=args.seq_len, loss_role=Role.ASSISTANT)
    run = args.out / "run"
    checkpoints = Checkpoints(run, keep=1)
    trainer = Trainer(objective, optax.adamw(args.lr), key=jax.random.key(0), checkpoints=checkpoints)
    state = trainer.fit(chats.load(batch=8), steps=steps, log_every=max(1, steps // 5), checkpoint_every=steps)
    RunConfig(model=ModelConfig.from_model(adapted.model),
              objective=ObjectiveConfig.from_objective(objective)).save(run)

    adapter = adapted.save_adapter(args.out / "adapter", state.variables, overwrite=True)
    question = FACTS[0][0]
    prompt = chats.template.render([{"role": "user", "content": question}], add_generation_prompt=True)
    task = adapted.text_generation(Sampling(temperature=0.0, eos_token_ids=(pretrained.tokenizer.eos_id,)),
                                   variables=state.variables)
    answer = task([prompt], 8, key=jax.random.key(1)).text[0]
    result = {
        "steps": int(state.step),
        "first_loss": trainer.history[0]["loss"],
        "last_loss": trainer.history[-1]["loss"],
        "adapter": str(adapter),
        "trained_tensors": sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(state.variables["params"])),
        "frozen_tensors": sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(state.variables["base"])),
        "question": question,
        "answer": answer,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
