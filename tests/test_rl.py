"""dew.rl: advantages, masked statistics, policy/value losses and KL estimators against direct
NumPy computations."""

import jax.numpy as jnp
import numpy as np
import pytest

from dew import rl


def recursive_gae(rewards, values, dones, gamma, lam):
    """GAE written as the textbook backward recursion, one episode step at a time."""
    steps = len(rewards)
    advantages = np.zeros(steps)
    running = 0.0
    for t in reversed(range(steps)):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * live - values[t]
        running = delta + gamma * lam * live * running
        advantages[t] = running
    return advantages


def test_gae_matches_the_direct_recursion_with_episode_ends_and_a_bootstrap():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 7))
    values = rng.normal(size=(3, 8))
    dones = (rng.random((3, 7)) < 0.3).astype(np.float32)
    advantages, returns = rl.gae(rewards, values, dones, gamma=0.9, lam=0.8)
    for row in range(3):
        expected = recursive_gae(rewards[row], values[row], dones[row], 0.9, 0.8)
        np.testing.assert_allclose(np.asarray(advantages[row]), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(returns[row]), expected + values[row, :-1], rtol=1e-5, atol=1e-5)
    # without a bootstrap value the step after the horizon counts 0
    short, _ = rl.gae(rewards[0], values[0, :-1], np.zeros(7), gamma=0.9, lam=0.8)
    np.testing.assert_allclose(np.asarray(short), recursive_gae(rewards[0], values[0, :-1], np.zeros(7), 0.9, 0.8),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="T or T \\+ 1"):
        rl.gae(rewards, values[:, :3], dones)


def test_group_advantages_have_zero_mean_per_group_and_unit_scale():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.0, 2.0, 4.0, 6.0])
    advantages = np.asarray(rl.group_advantages(rewards, groups=4)).reshape(3, 4)
    np.testing.assert_allclose(advantages.mean(axis=1), 0.0, atol=1e-6)
    np.testing.assert_allclose(advantages[1], 0.0)  # equal rewards teach nothing
    grouped = rewards.reshape(3, 4)
    expected = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5)
    raw = np.asarray(rl.group_advantages(rewards, groups=4, normalize=False)).reshape(3, 4)
    np.testing.assert_allclose(raw, grouped - grouped.mean(1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="multiple of groups"):
        rl.group_advantages(rewards[:10], groups=4)


def test_rloo_subtracts_the_mean_of_the_other_responses():
    rewards = np.array([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    advantages = np.asarray(rl.rloo_advantages(rewards, groups=3))
    expected = [1 - 4, 2 - 3.5, 6 - 1.5, 0 - 1.5, 0 - 1.5, 3 - 0]
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)
    with pytest.raises(ValueError, match="rloo_advantages groups .* must be an integer >= 2; got 1"):
        rl.rloo_advantages(rewards, groups=1)


def test_masked_mean_and_whiten_ignore_masked_out_entries():
    x = np.array([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    assert float(rl.masked_mean(x, mask)) == pytest.approx(2.5)
    np.testing.assert_allclose(np.asarray(rl.masked_mean(x, mask, axis=1)), [1.5, 3.5])
    assert float(rl.masked_mean(x, np.zeros_like(mask))) == 0.0
    white = np.asarray(rl.masked_whiten(x, mask))
    kept = white[mask == 1]
    assert kept.mean() == pytest.approx(0.0, abs=1e-6)
    assert kept.std() == pytest.approx(1.0, rel=1e-4)
    shifted = np.asarray(rl.masked_whiten(x, mask, shift_mean=False))[mask == 1]
    assert shifted.mean() == pytest.approx(2.5, rel=1e-5)


def test_clipped_surrogate_and_value_loss_match_their_formulas():
    rng = np.random.default_rng(1)
    log_ratio = rng.normal(scale=0.5, size=20)
    advantages = rng.normal(size=20)
    ratio = np.exp(log_ratio)
    expected = -np.minimum(ratio * advantages, np.clip(ratio, 0.8, 1.2) * advantages)
    np.testing.assert_allclose(np.asarray(rl.clipped_surrogate(log_ratio, advantages, 0.2)), expected, rtol=1e-5)
    clipped = np.asarray(rl.clip_fraction(log_ratio, advantages, 0.2))
    np.testing.assert_array_equal(clipped, (np.clip(ratio, 0.8, 1.2) * advantages < ratio * advantages))

    values, old, returns = rng.normal(size=(3, 20))
    moved = old + np.clip(values - old, -0.3, 0.3)
    expected = 0.5 * np.maximum((values - returns) ** 2, (moved - returns) ** 2)
    np.testing.assert_allclose(np.asarray(rl.value_loss(values, old, returns, 0.3)), expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rl.value_loss(values, old, returns, None)),
                               0.5 * (values - returns) ** 2, rtol=1e-5)


def test_kl_estimators_follow_schulman_and_k3_is_unbiased():
    logp = np.log(np.array([0.5, 0.2, 0.3]))
    ref = np.log(np.array([0.3, 0.3, 0.4]))
    np.testing.assert_allclose(np.asarray(rl.kl_k1(logp, ref)), logp - ref, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rl.kl_k2(logp, ref)), 0.5 * (logp - ref) ** 2, rtol=1e-6)
    k3 = np.asarray(rl.kl_k3(logp, ref))
    np.testing.assert_allclose(k3, np.exp(ref - logp) - (ref - logp) - 1, rtol=1e-5)
    assert (k3 >= 0).all()
    # The expectation under pi of k1 and k3 is KL(pi || ref).
    p = np.exp(logp)
    exact = float(np.sum(p * (logp - ref)))
    assert float(np.sum(p * k3)) == pytest.approx(exact, rel=1e-5)
    assert float(np.sum(p * np.asarray(rl.kl_k1(logp, ref)))) == pytest.approx(exact, rel=1e-5)
    assert float(jnp.sum(rl.kl_k3(ref, ref))) == 0.0
