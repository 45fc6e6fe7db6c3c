"""MDLM: the log-linear schedule and ELBO weights, the objective's loss and perplexity, generation
of exactly `length` clean tokens, training on Shakespeare bytes, and bad input."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Evaluation, Trainer
from dew.data import ByteTokenizer, Loading, TokenWindows, tokenize
from dew.diffusion.discrete import MDLM, MaskedDiffusion
from dew.inference.masked import MaskedGeneration
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Step
from dew.objectives.lm import Perplexity
from dew.objectives.masked import MaskedDiffusionObjective

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
MASK = 256


def bidirectional(vocab=MASK + 1, max_seq_len=64, **kw):
    return CausalTransformer(vocab_size=vocab, emb_features=32, num_layers=1, num_heads=2, mlp_features=64,
                             max_seq_len=max_seq_len, causal=False, **kw)


def test_log_linear_schedule_and_elbo_weight():
    process = MDLM(mask_id=MASK)()
    assert isinstance(process, MaskedDiffusion)
    t = jnp.array([0.1, 0.5, 1.0])
    np.testing.assert_allclose(np.asarray(process.mask_probability(t)), (1 - 1e-3) * np.asarray(t), rtol=1e-6)
    # -alpha'_t / (1 - alpha_t) = 1 / t for alpha_t = 1 - (1 - eps) t
    np.testing.assert_allclose(np.asarray(process.weight(t)), 1 / np.asarray(t), rtol=1e-5)
    times = np.asarray(process.sample_times(jax.random.key(0), 8))
    assert times.min() >= 1e-3 and times.max() <= 1.0
    assert np.allclose(np.sort(np.diff(np.sort(times))), (1 - 1e-3) / 8, atol=1e-5)  # stratified
    tokens = jnp.zeros((4, 2000), jnp.int32)
    noisy, masked = process.corrupt(jax.random.key(1), tokens, jnp.array([0.1, 0.4, 0.7, 1.0]))
    np.testing.assert_allclose(np.asarray(masked.mean(1)), [0.1, 0.4, 0.7, 1.0], atol=0.04)
    assert (np.asarray(noisy)[np.asarray(masked)] == MASK).all()


def test_loss_is_the_weighted_cross_entropy_of_masked_tokens_only():
    process = MDLM(mask_id=4)()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    tokens = np.array([[0, 1, 2], [3, 3, 0]])
    masked = np.array([[True, False, True], [False, True, False]])
    t = np.array([0.25, 0.5], np.float32)
    clean = logits[..., :4]  # SUBS: the mask id gets no probability
    log_probs = clean - np.log(np.exp(clean).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, tokens[..., None], -1)[..., 0]
    expected = np.where(masked, nll, 0) / t[:, None]
    got = process.token_losses(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(masked), jnp.asarray(t))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


def test_evaluate_feeds_perplexity_exp_of_the_elbo():
    model = bidirectional(vocab=17, max_seq_len=16)
    objective = MaskedDiffusionObjective(model, MDLM(mask_id=16)(), seq_len=16)
    variables = objective.init(jax.random.key(0))
    batch = {"text": np.random.default_rng(0).integers(0, 16, (4, 16)).astype(np.int32)}
    outputs = jax.jit(objective.evaluate)(variables, batch, Step(0, jax.random.key(1)))
    assert float(outputs["_tokens"]) == 64
    result = Evaluation.run(objective, variables, lambda p: iter([batch]), metrics=(Perplexity(),),
                            key=jax.random.key(1))
    scores = {name.split("/")[-1]: value for name, value in result.scores.items()}
    assert scores["perplexity"] == pytest.approx(np.exp(scores["loss"]), rel=1e-4), result.scores


def test_generate_returns_exactly_length_unmasked_tokens_after_each_prompt():
    model = bidirectional(max_seq_len=32)
    process = MDLM(mask_id=MASK)()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode("Once upon"), tokenizer.encode("A")]
    drawn = process.generate(model, variables, prompts, 12, key=jax.random.key(1), steps=6).host()
    assert drawn.tokens.shape == (2, 12)
    assert (drawn.tokens != MASK).all() and (drawn.tokens < MASK).all()
    np.testing.assert_array_equal(drawn.lengths, [12, 12])
    again = process.generate(model, variables, prompts, 12, key=jax.random.key(1), steps=6).host()
    np.testing.assert_array_equal(drawn.tokens, again.tokens)
    greedy = process.generate(model, variables, prompts, 5, key=jax.random.key(2), steps=1, temperature=0.0)
    assert greedy.tokens.shape == (2, 5)

    task = MaskedGeneration(model, variables, MDLM(mask_id=MASK), processor=tokenizer, steps=4)
    texts = task.decode(task(["Once upon", "A"], 7, seed=0))
    assert len(texts) == 2
    with pytest.raises(ValueError, match="exactly one of seed= .* or key="):
        task(["A"], 3)


def test_bad_input_fails_with_clear_errors():
    process = MDLM(mask_id=MASK)()
    with pytest.raises(ValueError, match="mask_id=256 is outside the model's vocabulary of 256"):
        MaskedDiffusionObjective(bidirectional(vocab=256), process, seq_len=16)
    with pytest.raises(ValueError, match="causal=False"):
        MaskedDiffusionObjective(CausalTransformer(vocab_size=257, emb_features=32, num_layers=1, num_heads=2,
                                                   max_seq_len=16), process, seq_len=16)
    objective = MaskedDiffusionObjective(bidirectional(), process, seq_len=16)
    clean = np.zeros((2, 16), np.int32)
    objective.check({"text": clean})
    with pytest.raises(ValueError, match="contains the mask id 256"):
        objective.check({"text": np.where(np.eye(2, 16, dtype=bool), MASK, clean)})
    with pytest.raises(ValueError, match="rows hold 17 ids.*exactly seq_len.*TokenWindows\\(seq_len=15\\)"):
        objective.check({"text": np.zeros((2, 17), np.int32)})
    model = bidirectional(vocab=256)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="mask_id=256 is outside"):
        process.generate(model, variables, [[1, 2]], 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="prompt 0 contains the mask id"):
        MDLM(mask_id=5)().generate(model, variables, [[1, 5]], 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        process.generate(bidirectional(), variables, [[1, 2]], 63, key=jax.random.key(0))
    with pytest.raises(ValueError, match="mask_id must be an integer >= 0"):
        MDLM(mask_id=-1)()


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"tinyshakespeare is not at {SHAKESPEARE} (the shared data folder)")
def test_the_elbo_falls_while_training_on_shakespeare_bytes(tmp_path):
    (tmp_path / "in.txt").write_text(SHAKESPEARE.read_text()[:60000])
    tokenize(tmp_path / "in.txt", tmp_path / "tokens", "byte", val_fraction=0.1)
    data = TokenWindows(path=tmp_path / "tokens", seq_len=31, loading=Loading(workers=0)).load(batch=16)
    model = bidirectional(max_seq_len=32)
    # the live weights are evaluated: 60 steps are too few for a 0.999 average to move
    objective = MaskedDiffusionObjective(model, MDLM(mask_id=MASK)(), seq_len=32, ema_decay=None)
    trainer = Trainer(objective, optax.adamw(3e-3), key=jax.random.key(4))
    state = trainer.fit(data, steps=60, log_every=30, eval_every=60, metrics=(Perplexity(),))
    losses = [row["loss"] for row in trainer.history]
    assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 1.0
    perplexity = trainer.evaluations[-1].scores["val/perplexity"]
    assert perplexity < np.exp(np.mean(losses[:5]))
    drawn = objective.generate(state.variables, [ByteTokenizer().encode("ROMEO:")], 16, key=jax.random.key(5), steps=8)
    assert drawn.tokens.shape == (1, 16) and int(jnp.max(drawn.tokens)) < MASK


def test_the_spec_masked_diffusion_program_samples_from_the_averaged_weights(tmp_path):
    """The README's masked-diffusion program as written (objective without ema_decay, sampling from
    `masked_state.averaged`), on an offline byte corpus at CPU sizes."""
    (tmp_path / "stories.txt").write_text("Once upon a time there was a little girl who loved the sea.\n\n" * 80)
    tokenize(tmp_path / "stories.txt", tmp_path / "tokens", "byte", val_fraction=0.1)
    tokenizer = ByteTokenizer()
    masked_data = TokenWindows(path=str(tmp_path / "tokens"), seq_len=31, loading=Loading(workers=0)).load(batch=8)
    mask_id = tokenizer.vocab_size
    process = MDLM(mask_id=mask_id)()
    masked_model = bidirectional(vocab=mask_id + 1, max_seq_len=32)
    masked_objective = MaskedDiffusionObjective(masked_model, process, seq_len=32)
    masked_state = Trainer(masked_objective, optax.adamw(1e-3), key=jax.random.key(4)).fit(
        masked_data, steps=4, log_every=2, eval_every=4, metrics=(Perplexity(),))
    drawn = process.generate(masked_model, masked_state.averaged,
                             [tokenizer.encode("Once upon a time")], 8, key=jax.random.key(5), steps=4)
    assert drawn.tokens.shape == (1, 8) and int(jnp.max(drawn.tokens)) < mask_id
