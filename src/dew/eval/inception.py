"""Inception-v3 as the FID network (Szegedy et al., 2015, https://arxiv.org/abs/1512.00567), in Flax.

This is the variant the FID papers measure with: TensorFlow's 2015-12-05 Inception graph, as
pytorch-fid ported it. It differs from torchvision's Inception-v3 in three places: the average pools
inside the A, C and first E blocks leave the padding out of the mean, and the last E block pools
with a max instead of an average. The 2048 features are the global average of Mixed_7c ("pool3").

Weights come only from a file the user supplies (nothing is downloaded): a .npz or .safetensors
holding pytorch-fid's state dict under its own names ("Conv2d_1a_3x3.conv.weight",
"Mixed_5b.branch1x1.bn.running_mean", ...). To make one from pytorch-fid's
pt_inception-2015-12-05-6726825d.pth:

    state = torch.load("pt_inception-2015-12-05-6726825d.pth", map_location="cpu")
    numpy.savez("pt_inception-2015-12-05.npz", **{k: v.numpy() for k, v in state.items()})
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

FEATURES = 2048
INPUT_SIZE = 299


class BasicConv(nn.Module):
    """Convolution without bias, batch norm (eps 1e-3, running statistics), ReLU."""

    features: int
    kernel: tuple[int, int]
    strides: int = 1
    padding: tuple[int, int] = (0, 0)

    @nn.compact
    def __call__(self, x):
        pad_h, pad_w = self.padding
        x = nn.Conv(
            self.features,
            self.kernel,
            strides=self.strides,
            padding=((pad_h, pad_h), (pad_w, pad_w)),
            use_bias=False,
            name="conv",
        )(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=1e-3, name="bn")(x)
        return nn.relu(x)


def _avg_pool_same(x):
    """3x3 average, stride 1, padding 1, with the padding left out of each mean (TensorFlow's way)."""
    return nn.avg_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)), count_include_pad=False)


def _max_pool(x, stride: int = 2, pad: int = 0):
    return nn.max_pool(x, (3, 3), strides=(stride, stride), padding=((pad, pad), (pad, pad)))


class BlockA(nn.Module):
    pool_features: int

    @nn.compact
    def __call__(self, x):
        b1 = BasicConv(64, (1, 1), name="branch1x1")(x)
        b5 = BasicConv(48, (1, 1), name="branch5x5_1")(x)
        b5 = BasicConv(64, (5, 5), padding=(2, 2), name="branch5x5_2")(b5)
        b3 = BasicConv(64, (1, 1), name="branch3x3dbl_1")(x)
        b3 = BasicConv(96, (3, 3), padding=(1, 1), name="branch3x3dbl_2")(b3)
        b3 = BasicConv(96, (3, 3), padding=(1, 1), name="branch3x3dbl_3")(b3)
        pool = BasicConv(self.pool_features, (1, 1), name="branch_pool")(_avg_pool_same(x))
        return jnp.concatenate([b1, b5, b3, pool], axis=-1)


class BlockB(nn.Module):
    @nn.compact
    def __call__(self, x):
        b3 = BasicConv(384, (3, 3), strides=2, name="branch3x3")(x)
        d = BasicConv(64, (1, 1), name="branch3x3dbl_1")(x)
        d = BasicConv(96, (3, 3), padding=(1, 1), name="branch3x3dbl_2")(d)
        d = BasicConv(96, (3, 3), strides=2, name="branch3x3dbl_3")(d)
        return jnp.concatenate([b3, d, _max_pool(x)], axis=-1)


class BlockC(nn.Module):
    channels_7x7: int

    @nn.compact
    def __call__(self, x):
        c = self.channels_7x7
        b1 = BasicConv(192, (1, 1), name="branch1x1")(x)
        b7 = BasicConv(c, (1, 1), name="branch7x7_1")(x)
        b7 = BasicConv(c, (1, 7), padding=(0, 3), name="branch7x7_2")(b7)
        b7 = BasicConv(192, (7, 1), padding=(3, 0), name="branch7x7_3")(b7)
        d = BasicConv(c, (1, 1), name="branch7x7dbl_1")(x)
        d = BasicConv(c, (7, 1), padding=(3, 0), name="branch7x7dbl_2")(d)
        d = BasicConv(c, (1, 7), padding=(0, 3), name="branch7x7dbl_3")(d)
        d = BasicConv(c, (7, 1), padding=(3, 0), name="branch7x7dbl_4")(d)
        d = BasicConv(192, (1, 7), padding=(0, 3), name="branch7x7dbl_5")(d)
        pool = BasicConv(192, (1, 1), name="branch_pool")(_avg_pool_same(x))
        return jnp.concatenate([b1, b7, d, pool], axis=-1)


class BlockD(nn.Module):
    @nn.compact
    def __call__(self, x):
        b3 = BasicConv(192, (1, 1), name="branch3x3_1")(x)
        b3 = BasicConv(320, (3, 3), strides=2, name="branch3x3_2")(b3)
        b7 = BasicConv(192, (1, 1), name="branch7x7x3_1")(x)
        b7 = BasicConv(192, (1, 7), padding=(0, 3), name="branch7x7x3_2")(b7)
        b7 = BasicConv(192, (7, 1), padding=(3, 0), name="branch7x7x3_3")(b7)
        b7 = BasicConv(192, (3, 3), strides=2, name="branch7x7x3_4")(b7)
        return jnp.concatenate([b3, b7, _max_pool(x)], axis=-1)


class BlockE(nn.Module):
    max_pool: bool = False  # the FID network's last block pools with a max

    @nn.compact
    def __call__(self, x):
        b1 = BasicConv(320, (1, 1), name="branch1x1")(x)
        b3 = BasicConv(384, (1, 1), name="branch3x3_1")(x)
        b3 = jnp.concatenate(
            [
                BasicConv(384, (1, 3), padding=(0, 1), name="branch3x3_2a")(b3),
                BasicConv(384, (3, 1), padding=(1, 0), name="branch3x3_2b")(b3),
            ],
            axis=-1,
        )
        d = BasicConv(448, (1, 1), name="branch3x3dbl_1")(x)
        d = BasicConv(384, (3, 3), padding=(1, 1), name="branch3x3dbl_2")(d)
        d = jnp.concatenate(
            [
                BasicConv(384, (1, 3), padding=(0, 1), name="branch3x3dbl_3a")(d),
                BasicConv(384, (3, 1), padding=(1, 0), name="branch3x3dbl_3b")(d),
            ],
            axis=-1,
        )
        pooled = _max_pool(x, stride=1, pad=1) if self.max_pool else _avg_pool_same(x)
        pool = BasicConv(192, (1, 1), name="branch_pool")(pooled)
        return jnp.concatenate([b1, b3, d, pool], axis=-1)


class FIDInception(nn.Module):
    """Inception-v3 up to pool3: images in [-1, 1], NHWC (299x299 for standard FID) -> [B, 2048]."""

    @nn.compact
    def __call__(self, x):
        x = BasicConv(32, (3, 3), strides=2, name="Conv2d_1a_3x3")(x)
        x = BasicConv(32, (3, 3), name="Conv2d_2a_3x3")(x)
        x = BasicConv(64, (3, 3), padding=(1, 1), name="Conv2d_2b_3x3")(x)
        x = _max_pool(x)
        x = BasicConv(80, (1, 1), name="Conv2d_3b_1x1")(x)
        x = BasicConv(192, (3, 3), name="Conv2d_4a_3x3")(x)
        x = _max_pool(x)
        x = BlockA(32, name="Mixed_5b")(x)
        x = BlockA(64, name="Mixed_5c")(x)
        x = BlockA(64, name="Mixed_5d")(x)
        x = BlockB(name="Mixed_6a")(x)
        for name, channels in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
            x = BlockC(channels, name=name)(x)
        x = BlockD(name="Mixed_7a")(x)
        x = BlockE(name="Mixed_7b")(x)
        x = BlockE(max_pool=True, name="Mixed_7c")(x)
        return jnp.mean(x, axis=(1, 2))


# ----------------------------------------------------------------------------------------------
# Weights


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every array in a .npz or .safetensors file (float tensors as float32)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Inception weights file {str(path)!r} does not exist. Dew never downloads weights: "
            "convert pytorch-fid's pt_inception-2015-12-05-6726825d.pth to .npz or .safetensors "
            "(see dew.eval.inception's docstring) and pass its path."
        )
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return {name: np.asarray(archive[name]) for name in archive.files}
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    raise ValueError(f"Inception weights must be a .npz or .safetensors file; got {str(path)!r}.")


_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file: it has {len(data)} bytes.")
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        dtype = entry["dtype"]
        if dtype == "BF16":
            start, end = entry["data_offsets"]
            raw = np.frombuffer(body[start:end], dtype="<u2").astype(np.uint32) << 16
            tensors[name] = raw.view(np.float32).reshape(entry["shape"])
            continue
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"Tensor {name!r} in {path} has dtype {dtype}, which is not a float or int.")
        start, end = entry["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=_SAFETENSORS_DTYPES[dtype])
        tensors[name] = array.reshape(entry["shape"])
    return tensors


def variables_from_torch(tensors: Mapping[str, np.ndarray], source: str = "the weights") -> dict[str, Any]:
    """Flax variables of `FIDInception` from pytorch-fid's state-dict names and layouts.

    Convolution kernels move from [out, in, h, w] to [h, w, in, out]; batch-norm weight/bias become
    scale/bias and the running statistics become `batch_stats` mean/var. The 1008-way classifier
    ("fc.*") and counters are ignored. Every tensor the network needs must be present with its shape.
    """
    expected = variable_shapes()
    flat: dict[tuple[str, ...], np.ndarray] = {}
    leaf = {"weight": "scale", "bias": "bias", "running_mean": "mean", "running_var": "var"}
    for name, value in tensors.items():
        parts = name.split(".")
        if parts[0] == "fc" or parts[-1] == "num_batches_tracked":
            continue
        *path, module, kind = parts
        if module == "conv" and kind == "weight":
            collection, key, value = "params", "kernel", np.transpose(value, (2, 3, 1, 0))
        elif module == "bn" and kind in leaf:
            collection = "batch_stats" if kind.startswith("running") else "params"
            key = leaf[kind]
        else:
            raise ValueError(
                f"{source} holds {name!r}, which is not a tensor of the FID Inception network "
                "(expected names such as 'Mixed_5b.branch1x1.conv.weight')."
            )
        flat[(collection, *path, module, key)] = np.asarray(value, dtype=np.float32)
    flat_expected = flatten_dict(expected)
    missing = sorted(set(flat_expected) - set(flat))
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} tensors of the FID Inception network, such as "
            f"{_torch_name(missing[0])!r}; is it pytorch-fid's pt_inception-2015-12-05 state dict?"
        )
    for key, shape_struct in flat_expected.items():
        if flat[key].shape != shape_struct.shape:
            raise ValueError(
                f"{source}: {_torch_name(key)!r} has shape {flat[key].shape} after moving to "
                f"Flax's layout, but the network expects {shape_struct.shape}."
            )
    extra = sorted(set(flat) - set(flat_expected))
    if extra:
        raise ValueError(
            f"{source} holds tensors the network does not have, such as {_torch_name(extra[0])!r}."
        )
    return unflatten_dict(flat)


@functools.lru_cache(maxsize=1)
def variable_shapes() -> dict[str, Any]:
    """The shapes of `FIDInception`'s variables (as jax.ShapeDtypeStruct leaves), without computing them."""
    import jax

    return jax.eval_shape(lambda: FIDInception().init(jax.random.key(0), jnp.zeros((1, 75, 75, 3))))


def torch_state_from_variables(variables: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The inverse of `variables_from_torch`: pytorch-fid's names and layouts (for tests and export)."""
    out = {}
    for key, value in flatten_dict(dict(variables)).items():
        out[_torch_name(key)] = (
            np.transpose(np.asarray(value), (3, 2, 0, 1)) if key[-1] == "kernel" else np.asarray(value)
        )
    return out


def random_torch_state(seed: int) -> dict[str, np.ndarray]:
    """pytorch-fid's whole state dict with random values: what tests use in place of its weights.

    The names and shapes are those of pt_inception-2015-12-05: the port's tensors, the 1008-way
    classifier ("fc.*") and each batch norm's "num_batches_tracked". The values depend on `seed`
    alone, so any environment rebuilds them with numpy: one `numpy.random.default_rng(seed)` fills
    the tensors in sorted-name order. Convolutions are He-normal (std sqrt(2 / fan_in), which keeps
    the 94 layers' outputs O(1)); batch-norm scales are uniform in [0.5, 1.5], shifts and running
    means normal with std 0.2 and running variances uniform in [0.5, 2], so the normalisation counts;
    the classifier is normal with std 0.01 and the counters are 0. tools/inception_fixtures.py runs
    pytorch-fid on this state, and tests/test_inception_parity.py checks the port against it.
    """
    shapes = _torch_shapes()
    shapes.update({"fc.weight": (1008, FEATURES), "fc.bias": (1008,)})
    rng = np.random.default_rng(seed)
    state = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("num_batches_tracked"):
            state[name] = np.zeros(shape, np.int64)
            continue
        if name.endswith("conv.weight"):
            value = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
        elif name.endswith("bn.weight"):
            value = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(("bn.bias", "running_mean")):
            value = rng.standard_normal(shape) * 0.2
        elif name.endswith("running_var"):
            value = rng.uniform(0.5, 2.0, shape)
        else:  # fc.weight, fc.bias
            value = rng.standard_normal(shape) * 0.01
        state[name] = value.astype(np.float32)
    return state


def _torch_shapes() -> dict[str, tuple[int, ...]]:
    """pytorch-fid's names and shapes for the port's tensors, and its batch-norm counters."""
    shapes = {}
    for key, leaf in flatten_dict(variable_shapes()).items():
        name = _torch_name(key)
        shape = tuple(leaf.shape)
        shapes[name] = tuple(shape[i] for i in (3, 2, 0, 1)) if key[-1] == "kernel" else shape
        if name.endswith(".running_mean"):
            shapes[name.removesuffix("running_mean") + "num_batches_tracked"] = ()
    return shapes


def _torch_name(key: tuple[str, ...]) -> str:
    kind = {"kernel": "weight", "scale": "weight", "bias": "bias", "mean": "running_mean",
            "var": "running_var"}[key[-1]]
    return ".".join([*key[1:-1], kind])

