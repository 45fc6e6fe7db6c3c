"""Post-training chain: supervised fine-tuning, then DPO, then GRPO, each stage starting from the
weights the last one ended with.

A tiny decoder learns to answer short questions in ChatML (the tiny-tools tokenizer's template):
SFT on conversations with the loss on the assistant's tokens only, DPO on right-versus-wrong
answers, and GRPO with a reward for answers that contain the expected word.

    python recipes/chain.py              # the full chain
    python recipes/chain.py --smoke      # a few steps per stage, to check it runs (< 1 minute)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import jax
import numpy as np
import optax

from dew import Dataset, Trainer
from dew.data import ChatMessages, HFTokenizer, Loading, PreferencePairs, Prompts
from dew.data.chat import Role
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.objectives.rl import DPOObjective, GRPOObjective, SampledRollout
from dew.sampling import Sampling

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizers" / "tiny-tools"

# (question, right answer, wrong answer)
FACTS = [
    ("What color is the sky?", "blue", "green"),
    ("What do cows drink?", "water", "stone"),
    ("What is hot?", "fire", "snow"),
    ("What do bees make?", "honey", "paper"),
    ("What do we read?", "books", "rocks"),
    ("Where do fish swim?", "water", "trees"),
    ("What shines at night?", "moon", "bread"),
    ("What do birds have?", "wings", "wheels"),
]


@dataclasses.dataclass
class Chain:
    """Settings of the three stages."""

    sft_steps: int = 300
    dpo_steps: int = 60
    grpo_steps: int = 40
    batch: int = 8
    seq_len: int = 63
    groups: int = 4
    max_new_tokens: int = 8
    smoke: bool = False
    seed: int = 0


def conversation(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": f"It is {answer}."}]}


def pair(chat: ChatMessages, question: str, chosen: str, rejected: str) -> dict:
    """A preference record: the same prompt, and response masks from the rendered roles."""
    record = {}
    for side, answer in (("chosen", chosen), ("rejected", rejected)):
        ids, roles = chat.render(conversation(question, answer))
        record[side] = [int(i) for i in ids]
        record[f"{side}_mask"] = [int(r == Role.ASSISTANT) for r in roles]
    return record


def run(settings: Chain) -> dict:
    if settings.smoke:
        settings = dataclasses.replace(settings, sft_steps=20, dpo_steps=4, grpo_steps=3)
    tokenizer = HFTokenizer(TOKENIZER)
    loading = Loading(workers=0)
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=64, num_layers=2, num_heads=4,
                              mlp_features=128, max_seq_len=settings.seq_len + 1)
    results: dict[str, dict] = {}
    started = time.perf_counter()

    # 1. SFT: the loss counts only the assistant's tokens.
    chat = ChatMessages([conversation(q, a) for q, a, _ in FACTS], tokenizer, settings.seq_len,
                        loading=loading, seed=settings.seed)
    sft = LMObjective(model, settings.seq_len, loss_role=Role.ASSISTANT, tokenizer=tokenizer)
    trainer = Trainer(sft, optax.adamw(3e-3), key=jax.random.key(settings.seed))
    state = trainer.fit(chat.load(batch=settings.batch), steps=settings.sft_steps, log_every=max(settings.sft_steps // 4, 1))
    results["sft"] = trainer.history[-1]

    # 2. DPO from the SFT weights: prefer the right answer to the wrong one.
    records = [pair(chat, q, right, wrong) for q, right, wrong in FACTS]
    pairs = PreferencePairs(records, seq_len=settings.seq_len + 1, loading=loading, seed=settings.seed,
                            pad_id=tokenizer.pad_id)
    dpo = DPOObjective(model, settings.seq_len, beta=0.1, variables=state.variables, tokenizer=tokenizer)
    trainer = Trainer(dpo, optax.adam(1e-3), key=jax.random.key(settings.seed + 1))
    state = trainer.fit(pairs.load(batch=settings.batch), steps=settings.dpo_steps, log_every=max(settings.dpo_steps // 2, 1))
    results["dpo"] = trainer.history[-1]

    # 3. GRPO from the DPO weights: reward answers that contain the expected word.
    prompt_records = [{"prompt": [{"role": "user", "content": q}], "data_source": "facts", "ground_truth": right}
                      for q, right, _ in FACTS]
    prompt_len = settings.seq_len + 1 - settings.max_new_tokens
    prompts = Prompts(prompt_records, prompt_len, tokenizer=tokenizer, loading=loading, seed=settings.seed)
    per_step = max(settings.batch // settings.groups, 1)
    grpo = GRPOObjective(model, settings.seq_len, beta=0.01, variables=state.variables, tokenizer=tokenizer)

    def reward(data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        return float(ground_truth in completion)

    rollout = SampledRollout(grpo, reward=reward, groups=settings.groups, max_new_tokens=settings.max_new_tokens,
                             sampling=Sampling(temperature=1.0, eos_token_ids=tokenizer.token_to_id("<|im_end|>"),
                                               pad_id=tokenizer.pad_id))
    trainer = Trainer(grpo, optax.adamw(1e-4), key=jax.random.key(settings.seed + 2), rollout=rollout)
    state = trainer.fit(prompts.load(batch=per_step), steps=settings.grpo_steps,
                        log_every=max(settings.grpo_steps // 2, 1))
    results["grpo"] = trainer.history[-1]

    answer = grpo.policy(state.variables, Sampling(temperature=0.0))
    prompt = prompts.columns()
    generation = answer([prompt["prompt"][0, : prompt["prompt_length"][0]]], settings.max_new_tokens, seed=0)
    results["sample"] = {"question": FACTS[0][0], "answer": tokenizer.decode(np.asarray(generation.tokens[0]))}
    results["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(results, default=float))
    return results


def main(argv=None) -> dict:
    import tyro

    return run(tyro.cli(Chain, args=argv))


if __name__ == "__main__":
    main()
