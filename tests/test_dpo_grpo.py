"""DPO and GRPO: the losses against closed forms, the frozen reference, preference and prompt data,
the sampled rollout, and short trainings that move the policy the way the reward asks."""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer
from dew.data import ByteTokenizer, HFTokenizer, Loading, Partition, PreferencePairs, Prompts
from dew.data.prompts import decode_text, encode_text
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Step
from dew.objectives.rl import DPOObjective, GRPOObjective, SampledRollout, dpo_loss, grpo_loss
from dew.sampling import Sampling

TOOLS = "tests/fixtures/tokenizers/tiny-tools"


def tiny(vocab=256, max_seq_len=32):
    return CausalTransformer(vocab_size=vocab, emb_features=32, num_layers=1, num_heads=2,
                             mlp_features=64, max_seq_len=max_seq_len)


def log_sigmoid(x):
    return -np.log1p(np.exp(-x))


# ----------------------------------------------------------------------------------------------
# Closed forms


def test_dpo_loss_matches_the_closed_form_on_hand_made_log_probs():
    pc, pr = np.array([-3.0, -5.0, -2.0]), np.array([-4.0, -4.5, -7.0])
    rc, rr = np.array([-3.5, -5.0, -2.5]), np.array([-3.0, -4.0, -6.0])
    beta = 0.5
    margin = beta * ((pc - rc) - (pr - rr))
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta)
    assert float(loss) == pytest.approx(float(np.mean(-log_sigmoid(margin))), rel=1e-6)
    assert float(metrics["reward_margin"]) == pytest.approx(float(margin.mean()), rel=1e-6)
    assert float(metrics["reward_accuracy"]) == pytest.approx(float(np.mean(margin > 0)))
    assert float(metrics["chosen_reward"]) == pytest.approx(float(np.mean(beta * (pc - rc))), rel=1e-6)
    smooth, _ = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=0.1)
    expected = np.mean(-0.9 * log_sigmoid(margin) - 0.1 * log_sigmoid(-margin))
    assert float(smooth) == pytest.approx(float(expected), rel=1e-6)


def test_grpo_loss_matches_the_closed_form_on_hand_made_log_probs():
    rng = np.random.default_rng(0)
    logp = -rng.random((3, 5)) * 3
    old = logp + rng.normal(scale=0.3, size=(3, 5))
    ref = logp + rng.normal(scale=0.3, size=(3, 5))
    advantages = np.array([1.0, -0.5, 0.25])
    mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.float32)
    clip, beta = 0.2, 0.05
    ratio = np.exp(logp - old)
    a = advantages[:, None]
    policy = -np.minimum(ratio * a, np.clip(ratio, 1 - clip, 1 + clip) * a)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    expected = np.sum((policy + beta * kl) * mask) / mask.sum()
    loss, metrics = grpo_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), advantages, mask,
                              clip=clip, beta=beta)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(metrics["kl"]) == pytest.approx(float(np.sum(kl * mask) / mask.sum()), rel=1e-5)
    no_kl, metrics = grpo_loss(jnp.asarray(logp), jnp.asarray(old), None, advantages, mask, clip=clip)
    assert float(no_kl) == pytest.approx(float(np.sum(policy * mask) / mask.sum()), rel=1e-5)
    assert "kl" not in metrics


# ----------------------------------------------------------------------------------------------
# DPO


def spec_pair(tokenizer=ByteTokenizer()):
    prompt, response, rejected = tokenizer.encode("Tom:"), tokenizer.encode(" a dog"), tokenizer.encode(" no")
    return {"chosen": prompt + response, "rejected": prompt + rejected,
            "chosen_mask": [0] * len(prompt) + [1] * len(response),
            "rejected_mask": [0] * len(prompt) + [1] * len(rejected)}


def test_preference_pairs_pad_to_seq_len_and_name_bad_records():
    pair = spec_pair()
    data = PreferencePairs(records=(json.dumps(pair),) * 4, seq_len=16, loading=Loading(workers=0)).load(batch=2)
    batch = next(iter(data.train(Partition())))
    assert set(batch) == {"chosen", "rejected", "chosen_mask", "rejected_mask"}
    assert batch["chosen"].shape == (2, 16) and batch["chosen"].dtype == np.int32
    np.testing.assert_array_equal(batch["chosen"][0, :10], pair["chosen"])
    np.testing.assert_array_equal(batch["chosen"][0, 10:], 0)
    np.testing.assert_array_equal(batch["rejected_mask"][0], pair["rejected_mask"] + [0] * 9)
    long = dict(pair, chosen=pair["chosen"] * 3, chosen_mask=pair["chosen_mask"] * 3)
    with pytest.raises(ValueError, match="record 1.*30 ids.*seq_len=16"):
        PreferencePairs(records=[pair, long], seq_len=16).columns()
    with pytest.raises(ValueError, match="record 0 has no \\['rejected_mask'\\]"):
        PreferencePairs(records=[{k: v for k, v in pair.items() if k != "rejected_mask"}], seq_len=16).columns()
    with pytest.raises(ValueError, match="chosen_mask has 3 entries"):
        PreferencePairs(records=[dict(pair, chosen_mask=[0, 1, 1])], seq_len=16).columns()


def test_preference_pairs_read_a_jsonl_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(spec_pair()) for _ in range(3)) + "\n")
    assert len(PreferencePairs(path, seq_len=12)) == 3


def test_dpo_scores_masked_response_log_probs_after_the_shift_and_keeps_the_reference_frozen():
    model = tiny()
    pair = spec_pair()
    columns = PreferencePairs(records=[pair, pair], seq_len=12).columns()
    batch = {k: jnp.asarray(v) for k, v in columns.items()}
    objective = DPOObjective(model, seq_len=11, beta=0.1)
    variables = jax.jit(objective.init)(jax.random.key(0))
    assert set(variables) == {"params", "reference"}

    def manual(params, tokens, mask):
        logits = jax.jit(model.apply)({"params": params}, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        picked = np.take_along_axis(np.asarray(logp), np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
        return (picked * np.asarray(mask)[:, 1:]).sum(1)

    policy, reference = jax.jit(objective.sequence_log_probs)(variables, batch)
    np.testing.assert_allclose(np.asarray(policy[:2]), manual(variables["params"], batch["chosen"], batch["chosen_mask"]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(policy[2:]), manual(variables["params"], batch["rejected"], batch["rejected_mask"]), rtol=1e-5)
    # The gradient reaches params only; the reference is data.
    def f(v):
        return objective.loss(v, batch, Step(0, jax.random.key(1)))[0]
    loss, grads = jax.jit(jax.value_and_grad(f))(variables)
    assert float(loss) == pytest.approx(math.log(2), rel=1e-6)  # the policy is its own reference
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree_util.tree_leaves(grads["reference"]))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(grads["params"]))

    with pytest.raises(ValueError, match="rows hold 12 ids.*DPOObjective\\(seq_len=11\\)"):
        DPOObjective(model, seq_len=15, beta=0.1).check(columns)


def test_dpo_training_raises_the_chosen_minus_rejected_log_ratio():
    model = tiny()
    base = jax.jit(DPOObjective(model, seq_len=15, beta=0.1).init)(jax.random.key(0))
    start = {"params": base["params"]}
    pairs = PreferencePairs(records=(json.dumps(spec_pair()),) * 8, seq_len=16,
                            loading=Loading(workers=0, threads=1, read_buffer=2)).load(batch=8)
    objective = DPOObjective(model, seq_len=15, beta=0.1, variables=start)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(2))
    state = trainer.fit(pairs, steps=10, log_every=5)
    batch = {k: jnp.asarray(v) for k, v in PreferencePairs(records=[spec_pair()], seq_len=16).columns().items()}
    scores = jax.jit(objective.sequence_log_probs)
    before, _ = scores(objective.init(None, start), batch)
    after, reference = scores(state.variables, batch)
    assert float(after[0] - after[1]) > float(before[0] - before[1]) + 1.0
    np.testing.assert_allclose(np.asarray(reference), np.asarray(before), rtol=1e-6)  # reference never moved
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]
    assert trainer.history[-1]["reward_accuracy"] == 1.0


# ----------------------------------------------------------------------------------------------
# Prompts and the rollout


def test_prompts_write_the_spec_layout_with_utf8_metadata():
    records = [{"prompt": [5, 6, 7], "data_source": "math", "ground_truth": "42", "extra_info": {"id": 1}},
               {"prompt": [8], "data_source": "café", "reward_model": {"ground_truth": "x"}}]
    columns = Prompts(records, prompt_len=4, pad_id=0).columns()
    np.testing.assert_array_equal(columns["prompt"], [[5, 6, 7, 0], [8, 0, 0, 0]])
    np.testing.assert_array_equal(columns["prompt_length"], [3, 1])
    assert all(columns[name].dtype == np.int32 for name in columns)
    assert [decode_text(row) for row in columns["data_source"]] == ["math", "café"]
    assert [decode_text(row) for row in columns["ground_truth"]] == ["42", "x"]
    assert json.loads(decode_text(columns["extra_info"][0])) == {"id": 1}
    assert decode_text(columns["extra_info"][1]) == ""
    np.testing.assert_array_equal(encode_text("dog"), np.frombuffer(b"dog", np.uint8).astype(np.int32))
    with pytest.raises(ValueError, match="record 0 has 3 tokens.*prompt_len=2"):
        Prompts(records, prompt_len=2).columns()
    tokenizer = HFTokenizer(TOOLS)
    chat = Prompts([{"prompt": [{"role": "user", "content": "hi"}]}], prompt_len=32, tokenizer=tokenizer).columns()
    text = tokenizer.decode(chat["prompt"][0, : chat["prompt_length"][0]])
    assert text.endswith("<|im_start|>assistant\n")


def spec_batch(prompt, rows=2, truth=b"7"):
    return {"prompt": np.tile(np.array(prompt, np.int32), (rows, 1)),
            "prompt_length": np.full(rows, len(prompt), np.int32),
            "data_source": np.tile(np.frombuffer(b"toy", np.uint8).astype(np.int32), (rows, 1)),
            "ground_truth": np.tile(np.frombuffer(truth, np.uint8).astype(np.int32), (rows, 1)),
            "extra_info": np.zeros((rows, 0), np.int32)}


def digits(ids):
    return " ".join(str(int(i)) for i in ids) + " "


def test_sampled_rollout_writes_static_rows_with_old_log_probs_and_group_advantages():
    model = tiny(vocab=16, max_seq_len=16)
    objective = GRPOObjective(model, seq_len=8, beta=0.1)
    variables = jax.jit(objective.init)(jax.random.key(0))
    seen = []

    def reward(data_source, completion, ground_truth, extra_info):
        seen.append((data_source, ground_truth, extra_info))
        return float(len(completion))

    rollout = SampledRollout(objective, reward=reward, groups=4, max_new_tokens=5,
                             sampling=Sampling(temperature=1.0, top_k=8, eos_token_ids=3), decode=digits)
    batch = rollout(variables, spec_batch([1, 2, 4]), jax.random.key(1))
    assert seen[0] == ("toy", "7", "")
    assert batch["text"].shape == batch["response_mask"].shape == batch["old_log_probs"].shape == (8, 9)
    assert batch["advantages"].shape == batch["reward"].shape == (8,)
    np.testing.assert_allclose(batch["advantages"].reshape(2, 4).mean(1), 0.0, atol=1e-5)
    np.testing.assert_array_equal(batch["text"][:, :3], [[1, 2, 4]] * 8)
    np.testing.assert_array_equal(batch["response_mask"][:, :3], 0)
    assert (batch["response_mask"].sum(1) >= 1).all()
    assert (batch["old_log_probs"][batch["response_mask"] == 0] == 0).all()

    # On-policy, the old log-probs are the policy's own: the ratio is 1 and nothing clips.
    placed = {k: jnp.asarray(v) for k, v in batch.items()}
    logp = jax.jit(objective.token_log_probs)({"params": variables["params"]}, placed["text"])
    mask = batch["response_mask"][:, 1:] == 1
    np.testing.assert_allclose(np.asarray(logp)[mask], batch["old_log_probs"][:, 1:][mask], atol=1e-4)
    loss, aux = jax.jit(objective.loss)(variables, placed, Step(0, jax.random.key(2)))
    expected = -np.sum(batch["advantages"][:, None] * mask) / mask.sum()
    assert float(loss) == pytest.approx(float(expected), abs=1e-4)
    assert float(aux.metrics["clip_fraction"]) == 0.0
    assert float(aux.metrics["reward"]) == pytest.approx(float(batch["reward"].mean()))

    again = rollout(variables, spec_batch([9]), jax.random.key(3))  # a shorter prompt: same shapes
    assert {k: v.shape for k, v in again.items()} == {k: v.shape for k, v in batch.items()}


def test_a_reward_that_raises_or_returns_a_non_number_is_named_by_prompt():
    model = tiny(vocab=16, max_seq_len=16)
    objective = GRPOObjective(model, seq_len=8)
    variables = jax.jit(objective.init)(jax.random.key(0))

    def broken(data_source, completion, ground_truth, extra_info):
        raise KeyError("oops")

    with pytest.raises(RuntimeError, match="reward function raised on prompt 0.*KeyError"):
        SampledRollout(objective, reward=broken, groups=2, max_new_tokens=3, decode=digits)(
            variables, spec_batch([1, 2]), jax.random.key(1))
    with pytest.raises(TypeError, match="finite number; on prompt 0.*'yes'"):
        SampledRollout(objective, reward=lambda *a: "yes", groups=2, max_new_tokens=3, decode=digits)(
            variables, spec_batch([1, 2]), jax.random.key(1))
    with pytest.raises(ValueError, match="seq_len >= 9"):
        SampledRollout(objective, reward=lambda *a: 1.0, groups=2, max_new_tokens=8, decode=digits)(
            variables, spec_batch([1, 2]), jax.random.key(1))
    with pytest.raises(ValueError, match="groups .* must be an integer >= 2; got 1"):
        SampledRollout(objective, reward=lambda *a: 1.0, groups=1, decode=digits)
    with pytest.raises(ValueError, match="rollout=SampledRollout"):
        objective.check(spec_batch([1, 2]))


def test_grpo_raises_the_share_of_responses_with_the_rewarded_token():
    """A 32-token toy: the reward asks for token 7, which a fresh policy writes in ~9% of responses."""
    model = tiny(vocab=32, max_seq_len=16)
    objective = GRPOObjective(model, seq_len=5, beta=0.0)
    rollout = SampledRollout(objective, reward=lambda ds, c, gt, ei: float((" " + c).find(" " + gt + " ") >= 0),
                             groups=8, max_new_tokens=3, sampling=Sampling(temperature=1.0), decode=digits)
    batch = spec_batch([1, 2, 3], rows=4)
    data = Dataset(train=lambda partition: itertools.repeat(batch), records=4, batch=4)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout)

    def share(variables):
        drawn = objective.policy(variables, Sampling(temperature=1.0))([[1, 2, 3]], 3, seed=1, n=256).host()
        return float(np.mean([(row == 7).any() for row in drawn.tokens]))

    before = share(trainer.init_state().variables)
    state = trainer.fit(data, steps=10, log_every=5)
    after = share(state.variables)
    assert before < 0.25
    assert after > before + 0.4
    assert trainer.history[-1]["reward"] > trainer.history[0]["reward"]


@pytest.mark.slow
def test_the_sft_dpo_grpo_chain_recipe_runs():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / "chain.py"
    spec = importlib.util.spec_from_file_location("chain_recipe", path)
    chain = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = chain  # dataclasses look their module up while the file runs
    spec.loader.exec_module(chain)
    results = chain.main(["--smoke"])
    assert results["dpo"]["reward_accuracy"] > 0.5
    assert set(results) >= {"sft", "dpo", "grpo", "sample"}
