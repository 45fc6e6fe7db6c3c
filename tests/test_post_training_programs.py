"""The spec's SFT, preference and GRPO programs, run as written on byte tokens of tinyshakespeare.

Sizes change for bytes (a GPT-2 token is several bytes, so rows are wider) and for a CPU.
"""

import itertools
import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer
from dew.data import ByteTokenizer, Loading, PreferencePairs, TokenWindows, tokenize
from dew.data.chat import Role
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.objectives.rl import DPOObjective, GRPOObjective, SampledRollout
from dew.sampling import Sampling

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"tinyshakespeare is not at {SHAKESPEARE}")
def test_sft_dpo_and_grpo_programs_continue_one_decoder(tmp_path):
    tokenize(SHAKESPEARE, tmp_path / "tokens", "byte", val_fraction=0.01)
    tokenizer = ByteTokenizer()
    data = TokenWindows(path=str(tmp_path / "tokens"), seq_len=64, loading=Loading(workers=0)).load(batch=8)
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=32, num_layers=1, num_heads=2,
                              mlp_features=64, max_seq_len=64)
    lm_state = Trainer(LMObjective(model, seq_len=64), optax.adamw(3e-3), key=jax.random.key(0)).fit(
        data, steps=30, log_every=30)

    # Supervised fine-tuning: only the response's targets count.
    prompt = tokenizer.encode("Tom had a red ball.")
    response = tokenizer.encode(" He kicked it to his dog.")
    row = np.array(prompt + response, dtype=np.int32)
    roles = np.array([Role.USER] * len(prompt) + [Role.ASSISTANT] * len(response), dtype=np.int8)
    sft_batch = {"text": np.tile(row, (8, 1)), "text_roles": np.tile(roles, (8, 1))}
    sft_data = Dataset(train=lambda partition: itertools.repeat(sft_batch), val=None, records=8, batch=8)
    sft_objective = LMObjective(model, seq_len=len(row) - 1, variables=lm_state.variables,
                                loss_role=Role.ASSISTANT)
    sft_trainer = Trainer(sft_objective, optax.adamw(1e-3), key=jax.random.key(2))
    sft_trainer.fit(sft_data, steps=20, log_every=10)
    assert sft_trainer.history[0]["tokens"] == 8 * len(response)  # assistant targets only, after the shift
    assert sft_trainer.history[-1]["loss"] < sft_trainer.history[0]["loss"]

    # Preference optimization from the pretrained weights.
    rejected = tokenizer.encode(" He kicked kicked kicked it.")
    pair = {"chosen": prompt + response, "rejected": prompt + rejected,
            "chosen_mask": [0] * len(prompt) + [1] * len(response),
            "rejected_mask": [0] * len(prompt) + [1] * len(rejected)}
    pairs = PreferencePairs(records=(json.dumps(pair),) * 8, seq_len=48,
                            loading=Loading(workers=0, threads=1, read_buffer=2)).load(batch=8)
    dpo = DPOObjective(model, seq_len=47, beta=0.1, variables=lm_state.variables)
    dpo_trainer = Trainer(dpo, optax.adam(0.001), key=jax.random.key(2))
    dpo_trainer.fit(pairs, steps=10, log_every=5)
    assert dpo_trainer.history[-1]["reward_margin"] > dpo_trainer.history[0]["reward_margin"]

    # GRPO with a reward function on decoded text.
    prompt = tokenizer.encode("Once upon a time, there was a little")
    prompt_batch = {
        "prompt": np.tile(np.array(prompt, dtype=np.int32), (8, 1)),
        "prompt_length": np.full(8, len(prompt), dtype=np.int32),
        "data_source": np.tile(np.frombuffer(b"tinyshakespeare", dtype=np.uint8).astype(np.int32), (8, 1)),
        "ground_truth": np.tile(np.frombuffer(b"e", dtype=np.uint8).astype(np.int32), (8, 1)),
        "extra_info": np.zeros((8, 0), dtype=np.int32),
    }
    seen = []

    def reward(data_source, completion, ground_truth, extra_info):
        seen.append((data_source, ground_truth))
        return float(ground_truth in completion)

    rl_data = Dataset(train=lambda partition: itertools.repeat(prompt_batch), val=None, records=8, batch=8)
    rl_objective = GRPOObjective(model, seq_len=len(prompt) + 7, beta=0.01, variables=lm_state.variables)
    rollout = SampledRollout(rl_objective, reward=reward, groups=4, max_new_tokens=8,
                             sampling=Sampling(temperature=1.0, top_k=40), decode=tokenizer.decode)
    rl_trainer = Trainer(rl_objective, optax.adamw(1e-4), key=jax.random.key(3), rollout=rollout)
    rl_state = rl_trainer.fit(rl_data, steps=4, log_every=2)
    assert int(rl_state.step) == 4
    assert seen[0] == ("tinyshakespeare", "e") and len(seen) == 4 * 8 * 4  # steps x prompts x groups
    assert all(np.isfinite(h["loss"]) for h in rl_trainer.history)


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"tinyshakespeare is not at {SHAKESPEARE}")
def test_grpo_teaches_a_rarely_written_word_to_most_responses(tmp_path):
    """A byte-level decoder pretrained briefly on Shakespeare rarely writes " the" after "ROMEO:";
    rewarding the word makes most of its responses contain it (3% -> 100% in one run)."""
    tokenize(SHAKESPEARE, tmp_path / "tokens", "byte", val_fraction=0.01)
    tokenizer = ByteTokenizer()
    data = TokenWindows(path=str(tmp_path / "tokens"), seq_len=64, loading=Loading(workers=0)).load(batch=16)
    model = CausalTransformer(vocab_size=256, emb_features=64, num_layers=2, num_heads=4, mlp_features=192,
                              max_seq_len=64)
    lm_state = Trainer(LMObjective(model, seq_len=64), optax.adamw(3e-3), key=jax.random.key(0)).fit(
        data, steps=300, log_every=100)
    prompt = tokenizer.encode("ROMEO:\n")
    batch = {"prompt": np.tile(np.array(prompt, np.int32), (8, 1)),
             "prompt_length": np.full(8, len(prompt), np.int32),
             "data_source": np.tile(np.frombuffer(b"play", np.uint8).astype(np.int32), (8, 1)),
             "ground_truth": np.tile(np.frombuffer(b"the", np.uint8).astype(np.int32), (8, 1)),
             "extra_info": np.zeros((8, 0), np.int32)}
    hits = []

    def reward(data_source, completion, ground_truth, extra_info):
        hits.append(ground_truth in completion)
        return float(ground_truth in completion)

    objective = GRPOObjective(model, seq_len=len(prompt) + 15, beta=0.01, variables=lm_state.variables)
    rollout = SampledRollout(objective, reward=reward, groups=4, max_new_tokens=16,
                             sampling=Sampling(temperature=1.0, top_k=40), decode=tokenizer.decode)
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=8, batch=8)
    Trainer(objective, optax.adamw(1e-3), key=jax.random.key(3), rollout=rollout).fit(data, steps=30, log_every=10)
    per_step = np.array(hits).reshape(30, 32).mean(axis=1)
    assert per_step[0] < 0.3
    assert per_step[-5:].mean() > 0.75
