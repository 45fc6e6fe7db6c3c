"""Record pytorch-fid's pool3 features on random weights, for the default suite to check Dew's port.

Writes tests/fixtures/inception/reference.npz (and a README.md beside it naming the versions), read
by tests/test_inception_parity.py, which needs no torch.

pytorch-fid builds its network in `fid_inception_v3()`: torchvision's Inception-v3 with the A, C and
E blocks replaced by its FID variants, then weights fetched from GitHub. Here the fetch
(`load_state_dict_from_url`) returns `dew.eval.inception.random_torch_state(STATE_SEED)` instead, so
every other line of pytorch-fid's construction and forward pass (resize to 299, [0, 1] -> [-1, 1],
blocks, pool3) runs unchanged. That state is made with numpy from the seed, so the test rebuilds it
without torch and reads it through `InceptionFeatures`, as a user would.

reference.npz holds:

    state_seed, image_seed, count     the random weights' seed; the images' seed and count per size
    features/<size>                   pytorch-fid's pool3 features [count, 2048] (float32) of
                                      `images(image_seed, count, size)`, for each size in SIZES
    controls/<name>                   the same weights and 299x299 images through networks that
                                      run torchvision's blocks in place of some FID ones (CONTROLS)

Run it in a throwaway environment of its own, never in .venv-ref: PyPI's torchvision is a CUDA build,
and beside the CPU build of torch it breaks transformers' model classes.

    python3 -m venv /tmp/fidenv
    /tmp/fidenv/bin/pip install torch==2.13.0 torchvision==0.28.0 pytorch-fid==0.3.0 -e .
    /tmp/fidenv/bin/python tools/inception_fixtures.py
"""

from __future__ import annotations

import copy
import pathlib
import sys
from importlib import metadata

import numpy as np
import torch

from dew.eval.inception import random_torch_state

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/inception"
STATE_SEED = 0
IMAGE_SEED = 0
COUNT = 3
SIZES = (299, 32, 400)  # 299: pytorch-fid's resize is the identity; 32 (CIFAR-10) and 400: bilinear
TOLERANCE = 1e-4  # the test's: max |Dew - pytorch-fid| / max |pytorch-fid|

# The FID blocks that each control runs with torchvision's forward instead
CONTROLS = {
    "torchvision_blocks": None,  # torchvision's own Inception-v3: all three FID differences at once
    "pools_count_padding": ["Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6b", "Mixed_6c", "Mixed_6d",
                            "Mixed_6e", "Mixed_7b"],  # A, C and the first E average over padded zeros
    "mixed_7c_averages": ["Mixed_7c"],  # the last block pools with an average instead of a max
}

_stand_in_ops = []  # keeps the op schemas below registered while the script runs


def import_torchvision():
    """torchvision, even beside a CPU-only torch.

    PyPI's torchvision 0.28.0 is built against CUDA torch; beside torch 2.13.0+cpu its C++ ops fail
    to load, and the import then stops registering a fake kernel for the missing `torchvision::nms`.
    The Inception models use no torchvision op, so declaring the two schemas it registers against
    lets the import finish; nothing here calls them.
    """
    try:
        import torchvision
    except RuntimeError as error:
        if "torchvision::nms" not in str(error):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "FRAGMENT")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _stand_in_ops.append(library)
        import torchvision
    return torchvision


torchvision = import_torchvision()
from pytorch_fid import inception as fid  # noqa: E402  (imports torchvision)


def images(seed: int, count: int, size: int) -> np.ndarray:
    """The test's images: uint8 [count, size, size, 3] (the same rule is in the test)."""
    return np.random.default_rng([seed, size]).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def pytorch_fid_network(state: dict[str, np.ndarray]):
    """pytorch-fid's InceptionV3([3]) with `state` in place of the downloaded weights."""
    fetched, built = [], []
    load_state_dict_from_url, fid_inception_v3 = fid.load_state_dict_from_url, fid.fid_inception_v3

    def fetch(url, progress=True):
        fetched.append(url)
        return {name: torch.from_numpy(value.copy()) for name, value in state.items()}

    def build():
        built.append(fid_inception_v3())
        return built[-1]

    fid.load_state_dict_from_url, fid.fid_inception_v3 = fetch, build
    try:
        network = fid.InceptionV3([3], resize_input=True, normalize_input=True).eval()
    finally:
        fid.load_state_dict_from_url, fid.fid_inception_v3 = load_state_dict_from_url, fid_inception_v3
    assert fetched == [fid.FID_WEIGHTS_URL]
    assert type(network.blocks[3][2]) is fid.FIDInceptionE_2

    # Dew's names and shapes (from the Flax port) are exactly those of pytorch-fid's network
    loaded = built[0].state_dict()
    assert sorted(loaded) == sorted(state), sorted(set(loaded) ^ set(state))
    for name, value in loaded.items():
        assert tuple(value.shape) == state[name].shape, (name, value.shape, state[name].shape)
        assert value.numpy().dtype == state[name].dtype, (name, value.dtype, state[name].dtype)
        np.testing.assert_array_equal(value.numpy(), state[name])
    return network


def control_network(network, state, blocks):
    """pytorch-fid's network with the listed FID blocks running torchvision's forward instead
    (`None`: torchvision's own Inception-v3 in pytorch-fid's wrapper)."""
    if blocks is None:
        plain = torchvision.models.inception_v3(num_classes=1008, aux_logits=False, weights=None,
                                                init_weights=False)
        plain.load_state_dict({name: torch.from_numpy(value.copy()) for name, value in state.items()})
        original = fid.fid_inception_v3
        fid.fid_inception_v3 = lambda: plain
        try:
            other = fid.InceptionV3([3], resize_input=True, normalize_input=True).eval()
        finally:
            fid.fid_inception_v3 = original
        assert type(other.blocks[3][2]) is torchvision.models.inception.InceptionE
        return other
    other = copy.deepcopy(network)
    modules = dict(other.named_modules())
    paths = {"Mixed_5b": "blocks.2.0", "Mixed_5c": "blocks.2.1", "Mixed_5d": "blocks.2.2",
             "Mixed_6b": "blocks.2.4", "Mixed_6c": "blocks.2.5", "Mixed_6d": "blocks.2.6",
             "Mixed_6e": "blocks.2.7", "Mixed_7b": "blocks.3.1", "Mixed_7c": "blocks.3.2"}
    for block in blocks:
        module = modules[paths[block]]
        module.__class__ = module.__class__.__bases__[0]  # FIDInceptionA -> torchvision's InceptionA
        assert module.__class__.__module__ == "torchvision.models.inception"
    return other


def pool3(network, batch: np.ndarray) -> np.ndarray:
    """pytorch-fid's input convention: float [0, 1], NCHW."""
    x = torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 255.0
    with torch.no_grad():
        (out,) = network(x)
    assert out.shape == (len(batch), 2048, 1, 1)
    return out[:, :, 0, 0].numpy().astype(np.float32)


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main():
    state = random_torch_state(STATE_SEED)
    network = pytorch_fid_network(state)
    arrays = {"state_seed": np.array(STATE_SEED), "image_seed": np.array(IMAGE_SEED),
              "count": np.array(COUNT)}
    for size in SIZES:
        features = pool3(network, images(IMAGE_SEED, COUNT, size))
        assert np.std(features) > 0.1 * np.max(np.abs(features))  # features that vary
        arrays[f"features/{size}"] = features
        print(f"features/{size}", features.shape, "max", float(features.max()))
    batch = images(IMAGE_SEED, COUNT, 299)
    distances = {}
    for name, blocks in CONTROLS.items():
        control = pool3(control_network(network, state, blocks), batch)
        distances[name] = relative_difference(arrays["features/299"], control)
        assert distances[name] > 100 * TOLERANCE, (name, distances[name])
        arrays[f"controls/{name}"] = control
        print(f"controls/{name}", f"{distances[name]:.3g} from pytorch-fid's features")

    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **arrays)
    versions = {name: metadata.version(name) for name in ("torch", "torchvision", "pytorch-fid", "numpy")}
    (OUT / "README.md").write_text(
        "pytorch-fid's pool3 features on random weights, read by tests/test_inception_parity.py.\n"
        "Written by tools/inception_fixtures.py (its docstring says what reference.npz holds), in\n"
        "an environment of its own:\n\n"
        "    python3 -m venv /tmp/fidenv\n"
        f"    /tmp/fidenv/bin/pip install torch=={versions['torch'].split('+')[0]} "
        f"torchvision=={versions['torchvision']} pytorch-fid=={versions['pytorch-fid']} -e .\n"
        "    /tmp/fidenv/bin/python tools/inception_fixtures.py\n\n"
        "Versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()) + ".\n"
        "Controls' distance from pytorch-fid's features (max abs difference over max |feature|, at\n"
        "299x299): " + ", ".join(f"{name} {d:.3g}" for name, d in distances.items()) + ".\n"
    )
    print(OUT / "reference.npz", (OUT / "reference.npz").stat().st_size, "bytes")


if __name__ == "__main__":
    main()
