"""Diffusion solvers, all with one signature (k-diffusion's sampling.py is the model).

Every solver works in sigma space, where ``x = x0 + sigma * eps`` and the probability-flow ODE is
``dx/dsigma = (x - D(x, sigma)) / sigma``. ``denoise(x, sigma) -> x0_hat`` takes a scalar sigma;
``sigmas`` is a descending grid of ``steps + 1`` levels (usually ending in 0). A VP or flow model
fits through the standard scaling x_sigma = x_t / alpha(t), sigma = sigma(t) / alpha(t), which
`dew.diffusion.Process.denoiser` does for you. DDIM, DPM-Solver(++) , UniPC and PNDM are invariant
under that scaling, so in sigma space they take the same steps as their VP formulations.

A solver is a frozen dataclass of settings; ``solver(denoise, x, sigmas, key) -> x`` runs it under
``lax.scan``, and ``solver.integrate(...)`` also returns the index of the first step whose result
was not finite (-1 if none), so callers can report it after the scan without a host sync inside.
A solver whose settings make it draw fresh noise (``solver.stochastic``) needs a key and raises
without one; a deterministic solver ignores the key and may be called without it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _scan(solver, step, x, sigmas, key, state):
    """Run ``step(i, x, state, key) -> (x, state)`` for i = 0 .. steps - 1 under lax.scan.

    Each step gets its own key split from `key`; a deterministic solver called without a key gets
    None in every step (it never reads it), a stochastic one raises before tracing.
    """
    solver.check_key(key)
    n = sigmas.shape[0] - 1
    keys = None if key is None else jax.random.split(key, n)

    def body(carry, inputs):
        x, state, bad = carry
        i, k = inputs
        x, state = step(i, x, state, k)
        bad = jnp.where((bad < 0) & ~jnp.all(jnp.isfinite(x)), i, bad).astype(jnp.int32)
        return (x, state, bad), None

    (x, _, bad), _ = lax.scan(body, (x, state, jnp.int32(-1)), (jnp.arange(n), keys))
    return x, bad


def _d(x, sigma, denoised):
    """The ODE derivative dx/dsigma (k-diffusion's to_d)."""
    return (x - denoised) / sigma


def _noise(key, x):
    return jax.random.normal(key, x.shape, x.dtype)


def _ancestral(sigma, sigma_next, eta):
    """Split a step into a deterministic move to sigma_down and fresh noise of size sigma_up, so
    that sigma_down^2 + sigma_up^2 = sigma_next^2 (eta = 1: the DDPM posterior)."""
    var = sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2
    up = jnp.minimum(sigma_next, eta * jnp.sqrt(jnp.maximum(var, 0.0)))
    return jnp.sqrt(jnp.maximum(sigma_next**2 - up**2, 0.0)), up


def _safe(sigma):
    """sigma, with 0 replaced by 1 so logs and divisions stay finite in branches not taken."""
    return jnp.where(sigma > 0, sigma, 1.0)


class Solver:
    """Base class: subclasses implement ``integrate``; those that draw noise override ``stochastic``."""

    @property
    def stochastic(self) -> bool:
        """Whether this solver, with these settings, adds fresh noise (and so needs a key)."""
        return False

    def __call__(self, denoise, x, sigmas, key=None):
        return self.integrate(denoise, x, sigmas, key)[0]

    def integrate(self, denoise, x, sigmas, key=None):
        raise NotImplementedError

    def check_key(self, key) -> None:
        """Raise when this solver draws noise and no key was given (there is no default key)."""
        if key is None and self.stochastic:
            raise ValueError(
                f"{self!r} is stochastic: it draws fresh noise at every step, so it needs a key. "
                f"Pass key=jax.random.key(seed) (a new key for each different sample), or choose a "
                f"deterministic solver such as Heun() or Euler()."
            )


# ---------------------------------------------------------------- first order


@dataclasses.dataclass(frozen=True)
class Euler(Solver):
    """Euler steps on the probability-flow ODE (Karras et al. 2022, Alg. 2 without churn)."""

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            return x + _d(x, s, denoise(x, s)) * (s_next - s), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class DDIM(Solver):
    """DDIM (Song et al. 2021): x' = x0_hat + sqrt(s'^2 - up^2) eps_hat + up z, with
    up = eta * sqrt(s'^2 (s^2 - s'^2) / s^2). eta = 0 is deterministic (Euler in sigma space);
    eta = 1 is DDPM's ancestral step."""

    eta: float = 0.0

    @property
    def stochastic(self) -> bool:
        return self.eta != 0

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            down, up = _ancestral(s, s_next, self.eta)
            x = denoised + down * _d(x, s, denoised)
            return (x + up * _noise(key, x) if self.stochastic else x), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class DDPM(Solver):
    """Ancestral sampling from DDPM's posterior q(x_s' | x_s, x0_hat) (Ho et al. 2020, Alg. 2):
    the mean x0 + (s'/s)^2 (x - x0) and variance s'^2 (s^2 - s'^2) / s^2 in sigma space."""

    @property
    def stochastic(self) -> bool:
        return True

    def integrate(self, denoise, x, sigmas, key=None):
        self.check_key(key)
        return DDIM(eta=1.0).integrate(denoise, x, sigmas, key)


@dataclasses.dataclass(frozen=True)
class EulerAncestral(Solver):
    """Euler steps to sigma_down, then noise of size sigma_up (k-diffusion's euler_ancestral)."""

    eta: float = 1.0
    s_noise: float = 1.0

    @property
    def stochastic(self) -> bool:
        return self.eta != 0 and self.s_noise != 0

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            down, up = _ancestral(s, s_next, self.eta)
            x = x + _d(x, s, denoise(x, s)) * (down - s)
            return (x + _noise(key, x) * self.s_noise * up if self.stochastic else x), state
        return _scan(self, step, x, sigmas, key, ())


# ---------------------------------------------------------------- Runge-Kutta


def _heun_step(denoise, x, s, s_next):
    """One Heun step from s to s_next; an Euler step when s_next is 0."""
    d = _d(x, s, denoise(x, s))
    x_euler = x + d * (s_next - s)

    def correct(_):
        d_next = _d(x_euler, s_next, denoise(x_euler, s_next))
        return x + (d + d_next) / 2 * (s_next - s)
    return lax.cond(s_next > 0, correct, lambda _: x_euler, None)


@dataclasses.dataclass(frozen=True)
class Heun(Solver):
    """Heun's second-order method (Karras et al. 2022, Alg. 1); the last step to 0 is Euler."""

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            return _heun_step(denoise, x, sigmas[i], sigmas[i + 1]), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class RK4(Solver):
    """The classical fourth-order Runge-Kutta method in sigma; the last step to 0 is Euler."""

    def integrate(self, denoise, x, sigmas, key=None):
        def f(x, s):
            return _d(x, s, denoise(x, s))

        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            h = s_next - s
            k1 = f(x, s)

            def rk4(_):
                k2 = f(x + h / 2 * k1, s + h / 2)
                k3 = f(x + h / 2 * k2, s + h / 2)
                k4 = f(x + h * k3, s_next)
                return x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            return lax.cond(s_next > 0, rk4, lambda _: x + h * k1, None), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class KDPM2(Solver):
    """DPM-Solver-2 in sigma space (k-diffusion's dpm_2, as diffusers' KDPM2DiscreteScheduler):
    a midpoint step whose midpoint is the geometric mean sqrt(s s'); the last step to 0 is Euler."""

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            d = _d(x, s, denoise(x, s))

            def midpoint(_):
                s_mid = jnp.sqrt(s * s_next)
                x_mid = x + d * (s_mid - s)
                return x + _d(x_mid, s_mid, denoise(x_mid, s_mid)) * (s_next - s)
            return lax.cond(s_next > 0, midpoint, lambda _: x + d * (s_next - s), None), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class EDMStochastic(Solver):
    """EDM's stochastic sampler (Karras et al. 2022, Alg. 2): raise the noise level by a factor
    1 + gamma (gamma = min(churn / steps, sqrt 2 - 1) for s_tmin <= sigma <= s_tmax) with fresh
    noise, then take a Heun step down. Defaults are the paper's ImageNet-64 settings."""

    churn: float = 40.0
    s_tmin: float = 0.05
    s_tmax: float = 50.0
    s_noise: float = 1.003

    @property
    def stochastic(self) -> bool:
        return self.churn > 0 and self.s_noise != 0

    def integrate(self, denoise, x, sigmas, key=None):
        n = sigmas.shape[0] - 1
        gamma_on = min(self.churn / n, math.sqrt(2.0) - 1.0)

        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            gamma = jnp.where((s >= self.s_tmin) & (s <= self.s_tmax), gamma_on, 0.0)
            s_hat = s * (1.0 + gamma)
            if self.stochastic:
                x = x + jnp.sqrt(jnp.maximum(s_hat**2 - s**2, 0.0)) * self.s_noise * _noise(key, x)
            return _heun_step(denoise, x, s_hat, s_next), state
        return _scan(self, step, x, sigmas, key, ())


# ---------------------------------------------------------------- linear multistep


def _lagrange_integrals(nodes, a, b, order, points):
    """∫_a^b L_j(tau) dtau for the Lagrange basis on nodes[:order] (Gauss-Legendre, exact)."""
    gx, gw = np.polynomial.legendre.leggauss(points)
    tau = (b - a) / 2 * gx + (a + b) / 2
    w = gw * (b - a) / 2
    out = []
    for j in range(order):
        p = jnp.ones_like(tau)
        for m in range(order):
            if m != j:
                den = nodes[j] - nodes[m]
                p = p * (tau - nodes[m]) / jnp.where(den == 0, 1.0, den)
        out.append(jnp.sum(w * p))
    return jnp.stack(out)


@dataclasses.dataclass(frozen=True)
class LMS(Solver):
    """Linear multistep (Adams-Bashforth on a non-uniform sigma grid), k-diffusion's lms and
    diffusers' LMSDiscreteScheduler: x' = x + sum_j c_j d_{i-j}, with c_j the integral over
    [s_i, s_{i+1}] of the Lagrange polynomial through the last `order` derivatives."""

    order: int = 4

    def integrate(self, denoise, x, sigmas, key=None):
        order = self.order

        def step(i, x, history, key):
            s = sigmas[i]
            history = jnp.concatenate([_d(x, s, denoise(x, s))[None], history[:-1]])
            nodes = sigmas[jnp.maximum(i - jnp.arange(order), 0)]
            rows = [jnp.pad(_lagrange_integrals(nodes, s, sigmas[i + 1], k, max(order, 2)),
                            (0, order - k)) for k in range(1, order + 1)]
            coeffs = jnp.stack(rows)[jnp.minimum(i, order - 1)]
            return x + jnp.tensordot(coeffs, history, 1), history
        return _scan(self, step, x, sigmas, key, jnp.zeros((order,) + x.shape, x.dtype))


@dataclasses.dataclass(frozen=True)
class PNDM(Solver):
    """Pseudo linear multistep (Liu et al. 2022), as diffusers' PNDMScheduler with skip_prk_steps:
    a Heun step first, then Adams-Bashforth 2, 3 and 4 with the fixed coefficients of a uniform
    grid, on eps = dx/dsigma. (Its "transfer" step equals a DDIM step, i.e. Euler in sigma space.)"""

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, history, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            d = _d(x, s, denoise(x, s))

            def heun(_):
                x_euler = x + d * (s_next - s)
                d_next = _d(x_euler, _safe(s_next), denoise(x_euler, _safe(s_next)))
                return jnp.where(s_next > 0, x + (d + d_next) / 2 * (s_next - s), x_euler)

            def adams(_):
                e1, e2, e3 = history
                eps = jnp.where(i == 1, (3 * d - e1) / 2,
                                jnp.where(i == 2, (23 * d - 16 * e1 + 5 * e2) / 12,
                                          (55 * d - 59 * e1 + 37 * e2 - 9 * e3) / 24))
                return x + eps * (s_next - s)
            x = lax.cond(i == 0, heun, adams, None)
            return x, jnp.concatenate([d[None], history[:-1]])
        return _scan(self, step, x, sigmas, key, jnp.zeros((3,) + x.shape, x.dtype))


@dataclasses.dataclass(frozen=True)
class DEIS(Solver):
    """DEIS (Zhang & Chen 2023), the exponential-integrator multistep on eps = dx/dsigma: eps is
    extrapolated by the Lagrange polynomial in log sigma through the last `order` values and
    integrated exactly over [s, s'] (diffusers' "logrho" variant), using
    ∫ P(u) e^u du = e^u (P - P' + P'') with u = log sigma."""

    order: int = 3

    def integrate(self, denoise, x, sigmas, key=None):
        order = self.order
        if order not in (1, 2, 3):
            raise ValueError(f"DEIS order must be 1, 2 or 3, got {order}")

        def antiderivative(rho, u_j, roots):
            u = jnp.log(_safe(rho))
            den = jnp.prod(jnp.stack([u_j - r for r in roots])) if roots else 1.0
            if not roots:
                p, dp, ddp = 1.0, 0.0, 0.0
            elif len(roots) == 1:
                p, dp, ddp = u - roots[0], 1.0, 0.0
            else:
                p, dp, ddp = (u - roots[0]) * (u - roots[1]), 2 * u - roots[0] - roots[1], 2.0
            den = jnp.where(den == 0, 1.0, den)
            return jnp.where(rho > 0, rho * (p - dp + ddp) / den, 0.0)

        def step(i, x, history, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            history = jnp.concatenate([_d(x, s, denoise(x, s))[None], history[:-1]])
            u = jnp.log(sigmas[jnp.maximum(i - jnp.arange(order), 0)])
            rows = []
            for k in range(1, order + 1):
                row = []
                for j in range(k):
                    roots = [u[m] for m in range(k) if m != j]
                    row.append(antiderivative(s_next, u[j], roots) - antiderivative(s, u[j], roots))
                rows.append(jnp.pad(jnp.stack(row), (0, order - k)))
            coeffs = jnp.stack(rows)[jnp.minimum(i, order - 1)]
            return x + jnp.tensordot(coeffs, history, 1), history
        return _scan(self, step, x, sigmas, key, jnp.zeros((order,) + x.shape, x.dtype))


# ---------------------------------------------------------------- DPM-Solver family


@dataclasses.dataclass(frozen=True)
class DPMSolver(Solver):
    """Singlestep DPM-Solver-1/2/3 (Lu et al. 2022, Algs. 1-2) in its noise-prediction form, with
    lambda = -log sigma and the intermediate points at r = 1/2 (order 2) or 1/3, 2/3 (order 3).
    The last step to sigma = 0 returns the denoised estimate."""

    order: int = 2

    def integrate(self, denoise, x, sigmas, key=None):
        if self.order not in (1, 2, 3):
            raise ValueError(f"DPMSolver order must be 1, 2 or 3, got {self.order}")

        def eps(x, lam):
            sigma = jnp.exp(-lam)
            return _d(x, sigma, denoise(x, sigma))

        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)

            def update(_):
                lam, lam_next = -jnp.log(s), -jnp.log(_safe(s_next))
                h = lam_next - lam
                e0 = _d(x, s, denoised)
                if self.order == 1:
                    return x - s_next * jnp.expm1(h) * e0
                if self.order == 2:
                    lam1 = lam + h / 2
                    u1 = x - jnp.exp(-lam1) * jnp.expm1(h / 2) * e0
                    e1 = eps(u1, lam1)
                    return x - s_next * jnp.expm1(h) * e0 - s_next * jnp.expm1(h) * (e1 - e0)
                r1, r2 = 1 / 3, 2 / 3
                lam1, lam2 = lam + r1 * h, lam + r2 * h
                u1 = x - jnp.exp(-lam1) * jnp.expm1(r1 * h) * e0
                e1 = eps(u1, lam1)
                u2 = (x - jnp.exp(-lam2) * jnp.expm1(r2 * h) * e0
                      - jnp.exp(-lam2) * (r2 / r1) * (jnp.expm1(r2 * h) / (r2 * h) - 1) * (e1 - e0))
                e2 = eps(u2, lam2)
                return (x - s_next * jnp.expm1(h) * e0
                        - s_next / r2 * (jnp.expm1(h) / h - 1) * (e2 - e0))
            return lax.cond(s_next > 0, update, lambda _: denoised, None), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class DPMSolverPP2M(Solver):
    """DPM-Solver++(2M) (Lu et al. 2022b, Alg. 2): multistep, data prediction, second order from the
    previous denoised output; the first step and the last step to 0 are first order."""

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            old_denoised = state
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            h = jnp.log(s) - jnp.log(_safe(s_next))
            h_last = jnp.log(sigmas[jnp.maximum(i - 1, 0)]) - jnp.log(s)
            r = h_last / h
            corrected = (1 + 1 / (2 * r)) * denoised - 1 / (2 * r) * old_denoised
            d = jnp.where(i > 0, corrected, denoised)
            x = jnp.where(s_next > 0, (s_next / s) * x - jnp.expm1(-h) * d, denoised)
            return x, denoised
        return _scan(self, step, x, sigmas, key, jnp.zeros_like(x))


@dataclasses.dataclass(frozen=True)
class DPMSolverPP2S(Solver):
    """DPM-Solver++(2S) (Lu et al. 2022b, Alg. 1), singlestep second order through the midpoint in
    lambda; eta > 0 makes it ancestral (k-diffusion's dpmpp_2s_ancestral)."""

    eta: float = 0.0
    s_noise: float = 1.0

    @property
    def stochastic(self) -> bool:
        return self.eta != 0 and self.s_noise != 0

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            down, up = _ancestral(s, s_next, self.eta)

            def second(_):
                h = jnp.log(s) - jnp.log(down)
                s_mid = s * jnp.exp(-h / 2)
                x_mid = (s_mid / s) * x - jnp.expm1(-h / 2) * denoised
                return (down / s) * x - jnp.expm1(-h) * denoise(x_mid, s_mid)
            x = lax.cond(down > 0, second, lambda _: denoised, None)
            return (x + _noise(key, x) * self.s_noise * up if self.stochastic else x), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class DPMSolverPPSDE(Solver):
    """DPM-Solver++(2M) SDE (Lu et al. 2022b; k-diffusion's dpmpp_2m_sde, midpoint form): the
    data-prediction SDE solver, second order from the previous denoised output, with fresh noise
    sigma' sqrt(1 - e^(-2 eta h)) each step. eta = 0 is DPM-Solver++(2M) with 'midpoint' terms."""

    eta: float = 1.0
    s_noise: float = 1.0

    @property
    def stochastic(self) -> bool:
        return self.eta != 0 and self.s_noise != 0

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, old_denoised, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            h = jnp.log(s) - jnp.log(_safe(s_next))
            h_last = jnp.log(sigmas[jnp.maximum(i - 1, 0)]) - jnp.log(s)
            eta_h = self.eta * h
            x_new = _safe(s_next) / s * jnp.exp(-eta_h) * x - jnp.expm1(-h - eta_h) * denoised
            r = h_last / h
            x_new = jnp.where(i > 0, x_new - 0.5 * jnp.expm1(-h - eta_h) / r * (denoised - old_denoised),
                              x_new)
            if self.stochastic:
                x_new = x_new + (_noise(key, x) * _safe(s_next) * jnp.sqrt(-jnp.expm1(-2 * eta_h))
                                 * self.s_noise)
            return jnp.where(s_next > 0, x_new, denoised), denoised
        return _scan(self, step, x, sigmas, key, jnp.zeros_like(x))


@dataclasses.dataclass(frozen=True)
class MultiStepDPM(Solver):
    """Multistep DPM-Solver++ in sigma space up to third order (k-diffusion's dpmpp_3m_sde): it keeps
    the last two denoised outputs and step sizes and raises each step's order with them (Lu et al.
    2022b, eq. for the 3M update with phi_2, phi_3). eta > 0 adds the SDE's noise."""

    order: int = 3
    eta: float = 0.0
    s_noise: float = 1.0

    @property
    def stochastic(self) -> bool:
        return self.eta != 0 and self.s_noise != 0

    def integrate(self, denoise, x, sigmas, key=None):
        if self.order not in (1, 2, 3):
            raise ValueError(f"MultiStepDPM order must be 1, 2 or 3, got {self.order}")

        def step(i, x, state, key):
            d1, d2 = state
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            lam = -jnp.log(sigmas[jnp.maximum(i - jnp.arange(3), 0)])
            h = -jnp.log(_safe(s_next)) - lam[0]
            h1, h2 = lam[0] - lam[1], lam[1] - lam[2]
            h_eta = h * (self.eta + 1)
            x_new = jnp.exp(-h_eta) * x - jnp.expm1(-h_eta) * denoised
            phi2 = jnp.expm1(-h_eta) / h_eta + 1
            phi3 = phi2 / h_eta - 0.5
            r0, r1 = h1 / h, h2 / h
            second = x_new + phi2 * (denoised - d1) / r0
            d1_0, d1_1 = (denoised - d1) / r0, (d1 - d2) / r1
            third = (x_new + phi2 * (d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1))
                     - phi3 * (d1_0 - d1_1) / (r0 + r1))
            cur = jnp.minimum(i + 1, self.order)
            x_new = jnp.where(cur == 3, third, jnp.where(cur == 2, second, x_new))
            if self.stochastic:
                x_new = x_new + (_noise(key, x) * _safe(s_next) * jnp.sqrt(-jnp.expm1(-2 * h * self.eta))
                                 * self.s_noise)
            return jnp.where(s_next > 0, x_new, denoised), (denoised, d1)
        return _scan(self, step, x, sigmas, key, (jnp.zeros_like(x), jnp.zeros_like(x)))


# ---------------------------------------------------------------- UniPC


def _unipc_rhos(rks, hh, order, predictor, variant):
    """UniPC's coefficients (Zhao et al. 2023, B(h) variants) for `order` terms."""
    h_phi_1 = jnp.expm1(hh)
    b_h = hh if variant == "bh1" else jnp.expm1(hh)
    h_phi_k, factorial, b = h_phi_1 / hh - 1, 1, []
    for k in range(1, order + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    b = jnp.stack(b)
    r = jnp.stack([rks**k for k in range(order)])
    if predictor:
        if order == 2:
            return jnp.array([0.5])
        return jnp.linalg.solve(r[:-1, :-1], b[:-1])
    if order == 1:
        return jnp.array([0.5])
    return jnp.linalg.solve(r, b)


@dataclasses.dataclass(frozen=True)
class UniPC(Solver):
    """UniPC (Zhao et al. 2023), as diffusers' UniPCMultistepScheduler with data prediction: a
    multistep predictor (UniP) and a corrector (UniC) that reuses the next step's model output, so
    each step costs one evaluation. Order ramps up over the first steps and down over the last."""

    order: int = 2
    variant: str = "bh2"

    def integrate(self, denoise, x, sigmas, key=None):
        if self.order not in (1, 2, 3) or self.variant not in ("bh1", "bh2"):
            raise ValueError(f"UniPC takes order 1, 2 or 3 and variant 'bh1' or 'bh2', got "
                             f"{self.order}, {self.variant!r}")
        n, p = sigmas.shape[0] - 1, self.order
        lam_of = lambda j: -jnp.log(_safe(sigmas[jnp.maximum(j, 0)]))  # noqa: E731

        def update(x, models, newest, j, order, predictor):
            """From sigmas[j] to sigmas[j+1], with models[k] the output at sigmas[j-k]."""
            s0, t = sigmas[j], sigmas[j + 1]
            h = lam_of(j + 1) - lam_of(j)
            rks = jnp.stack([(lam_of(j - k) - lam_of(j)) / h for k in range(1, order)] + [jnp.ones(())])
            rhos = _unipc_rhos(rks, -h, order, predictor, self.variant)
            d1s = [(models[k] - models[0]) / rks[k - 1] for k in range(1, order)]
            res = sum((rhos[k - 1] * d1s[k - 1] for k in range(1, order)), jnp.zeros_like(x))
            if not predictor:
                res = res + rhos[-1] * (newest - models[0])
            b_h = -h if self.variant == "bh1" else jnp.expm1(-h)
            x_t = t / s0 * x - jnp.expm1(-h) * models[0] - b_h * res
            return jnp.where(t > 0, x_t, models[0])

        def pick(orders, options):
            out = options[-1]
            for k in range(len(options) - 2, -1, -1):
                out = jnp.where(orders == k + 1, options[k], out)
            return out

        def step(i, x, state, key):
            models, last = state
            denoised = denoise(x, sigmas[i])
            order_c = jnp.minimum(jnp.minimum(p, n - i + 1), i)
            corrected = pick(order_c, [update(last, models, denoised, i - 1, k, False)
                                       for k in range(1, p + 1)])
            x = jnp.where(i > 0, corrected, x)
            models = jnp.concatenate([denoised[None], models[:-1]])
            order_p = jnp.minimum(jnp.minimum(p, n - i), i + 1)
            x_next = pick(order_p, [update(x, models, None, i, k, True) for k in range(1, p + 1)])
            return x_next, (models, x)
        return _scan(self, step, x, sigmas, key, (jnp.zeros((p,) + x.shape, x.dtype), x))


# ---------------------------------------------------------------- consistency samplers


@dataclasses.dataclass(frozen=True)
class LCM(Solver):
    """Multistep consistency sampling (Luo et al. 2023): jump to the denoised estimate, then renoise
    to the next level with fresh noise. Meant for consistency-distilled denoisers."""

    @property
    def stochastic(self) -> bool:
        return True

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s_next = sigmas[i + 1]
            return denoise(x, sigmas[i]) + s_next * _noise(key, x), state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class TCD(Solver):
    """Strategic stochastic sampling of Trajectory Consistency Distillation (Zheng et al. 2024): a
    deterministic DDIM move to the intermediate level (1 - gamma) s', then forward noise back up to
    s'. gamma = 0 is deterministic; gamma = 1 is LCM. (TCD picks (1 - gamma) of the timestep; here
    the fraction applies to the sigma-space level.)"""

    gamma: float = 0.3

    @property
    def stochastic(self) -> bool:
        return self.gamma != 0

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            s_mid = (1.0 - self.gamma) * s_next
            x = denoised + s_mid * _d(x, s, denoised)
            if self.stochastic:
                x = x + jnp.sqrt(jnp.maximum(s_next**2 - s_mid**2, 0.0)) * _noise(key, x)
            return x, state
        return _scan(self, step, x, sigmas, key, ())


SOLVERS = {cls.__name__: cls for cls in (
    DDPM, DDIM, Euler, EulerAncestral, Heun, RK4, KDPM2, EDMStochastic, LMS, PNDM, DEIS, DPMSolver,
    DPMSolverPP2M, DPMSolverPP2S, DPMSolverPPSDE, MultiStepDPM, UniPC, LCM, TCD)}
