"""The convolutions Dew runs in another form than XLA's convolution, against that form, in one process.

- upsample: nearest 2x upsampling then a 3x3 'same' conv (a UNet's or a VAE decoder's up block),
  as `jnp.repeat` + `lax.conv_general_dilated` against `dew.nn.vae.UpsampleConv` (four 2x2 convs
  at the input's size, interleaved).
- pointwise: a 1x1 conv, as `lax.conv_general_dilated` against `dew.nn.vae.PointwiseConv` (one
  matrix product over the pixels).

Each case is timed forward, and forward with backward (the gradient of a sum of the output with
respect to input and kernel), both forms jitted in the same process, the forms alternating over
--repeats rounds; figures are medians in milliseconds. The two forms' outputs are compared
(largest difference relative to the largest output). Prints one JSON line per case.

    .venv/bin/python benchmarks/conv_forms.py [--repeats 9] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import harness
from dew.nn.vae import PointwiseConv, UpsampleConv

NUMBERS = ("NHWC", "HWIO", "NHWC")
# (kind, batch, side, in channels, out channels): SD VAE decoder's upsamplings and shortcut at 256 px,
# and SD-UNet-sized levels
CASES = [
    ("upsample", 4, 128, 128, 128),
    ("upsample", 4, 64, 128, 128),
    ("upsample", 2, 32, 256, 256),
    ("upsample", 2, 16, 256, 256),
    ("upsample", 2, 8, 256, 256),
    ("pointwise", 4, 256, 128, 64),
    ("pointwise", 2, 64, 320, 320),
]
QUICK = [("upsample", 2, 16, 32, 32), ("pointwise", 2, 32, 32, 32)]


def plain(kind: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    if kind == "upsample":
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)), dimension_numbers=NUMBERS)
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "VALID", dimension_numbers=NUMBERS)


def dew_form(kind: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    module = UpsampleConv(kernel.shape[-1]) if kind == "upsample" else PointwiseConv(kernel.shape[-1])
    return module.apply({"params": {"kernel": kernel, "bias": jnp.zeros(kernel.shape[-1])}}, x)


def programs(form, kind: str) -> dict:
    forward = jax.jit(lambda x, k: form(kind, x, k))
    backward = jax.jit(jax.grad(lambda x, k: jnp.sum(form(kind, x, k)), argnums=(0, 1)))
    return {"forward": forward, "forward_backward": backward}


def measure(case: tuple, repeats: int) -> dict:
    kind, batch, side, channels, features = case
    x = jax.random.normal(jax.random.key(0), (batch, side, side, channels))
    taps = 3 if kind == "upsample" else 1
    kernel = jax.random.normal(jax.random.key(1), (taps, taps, channels, features)) / np.sqrt(taps * taps * channels)
    forms = {"xla_conv": programs(plain, kind), "dew": programs(dew_form, kind)}
    reference = np.asarray(forms["xla_conv"]["forward"](x, kernel))
    difference = np.abs(np.asarray(forms["dew"]["forward"](x, kernel)) - reference).max() / np.abs(reference).max()
    times = {(form, what): [] for form in forms for what in forms[form]}
    for program in (p for f in forms.values() for p in f.values()):
        jax.block_until_ready(program(x, kernel))  # compiles
    for _ in range(repeats):
        for (form, what), samples in times.items():
            start = time.perf_counter()
            jax.block_until_ready(forms[form][what](x, kernel))
            samples.append(time.perf_counter() - start)
    ms = {f"{form}_{what}_ms": round(1000 * statistics.median(s), 2) for (form, what), s in times.items()}
    return {"benchmark": "conv_forms", "kind": kind, "input": [batch, side, side, channels], "features": features,
            **ms, "relative_difference": float(difference), "hardware": harness.hardware(), "jax": jax.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (each form, alternating)")
    parser.add_argument("--quick", action="store_true", help="two small cases, 2 rounds")
    args = parser.parse_args()
    for case in QUICK if args.quick else CASES:
        print(json.dumps(measure(case, 2 if args.quick else args.repeats)), flush=True)


if __name__ == "__main__":
    main()
