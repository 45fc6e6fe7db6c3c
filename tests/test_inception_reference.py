"""Dew's FID Inception-v3 against pytorch-fid 0.3.0 itself, on random weights (nothing is downloaded).

pytorch-fid builds its network in `fid_inception_v3()`: torchvision's Inception-v3 with the A, C and
E blocks replaced by its FID variants, then weights fetched from GitHub. Here the fetch
(`load_state_dict_from_url`) returns a random state dict instead, so every other line of
pytorch-fid's construction and forward pass (resize to 299, [0, 1] -> [-1, 1], blocks, pool3) runs
unchanged. Dew reads the same state dict from an .npz through `InceptionFeatures`, as a user would.
Batch norm gets random scales, shifts and running statistics, so the ported normalisation counts.
"""

import copy
import sys

import numpy as np
import pytest

from dew.eval.image_metrics import InceptionFeatures

pytestmark = pytest.mark.reference

# pool3 features may differ from pytorch-fid's by this fraction of their largest value (float32 on
# both sides: the two libraries sum the convolutions in different orders)
TOLERANCE = 1e-4

_stand_in_ops = []  # keeps the op schemas below registered for the whole session


def _torchvision():
    """torchvision, even beside a CPU-only torch.

    PyPI's torchvision 0.28.0 is built against CUDA torch; beside torch 2.13.0+cpu its C++ ops fail
    to load, and the import then stops registering a fake kernel for the missing `torchvision::nms`.
    The Inception models use no torchvision op, so declaring the two schemas it registers against
    lets the import finish; nothing here calls them.
    """
    torch = pytest.importorskip("torch")
    pytest.importorskip("pytorch_fid")
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
    return torch, torchvision


@pytest.fixture(scope="module")
def reference():
    """pytorch-fid's InceptionV3([3]) with a random state dict in place of the downloaded one."""
    torch, torchvision = _torchvision()
    from pytorch_fid import inception as fid

    torch.manual_seed(0)
    shapes = torchvision.models.inception_v3(
        num_classes=1008, aux_logits=False, weights=None, init_weights=False
    ).state_dict()
    state = {}
    for name, value in shapes.items():
        if name.endswith("conv.weight"):  # He initialisation keeps the 94 layers' outputs O(1)
            new = torch.randn(value.shape) * (2.0 / value[0].numel()) ** 0.5
        elif name.endswith("bn.weight"):
            new = torch.empty(value.shape).uniform_(0.5, 1.5)
        elif name.endswith(("bn.bias", "running_mean")):
            new = torch.randn(value.shape) * 0.2
        elif name.endswith("running_var"):
            new = torch.empty(value.shape).uniform_(0.5, 2.0)
        elif name.startswith("fc."):
            new = torch.randn(value.shape) * 0.01
        else:  # num_batches_tracked
            new = value
        state[name] = new.contiguous()

    fetched = []

    def load_state_dict_from_url(url, progress=True):
        fetched.append(url)
        return copy.deepcopy(state)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fid, "load_state_dict_from_url", load_state_dict_from_url)
        network = fid.InceptionV3([3], resize_input=True, normalize_input=True).eval()
    assert fetched == [fid.FID_WEIGHTS_URL]
    assert type(network.blocks[3][2]) is fid.FIDInceptionE_2

    plain = torchvision.models.inception_v3(num_classes=1008, aux_logits=False, weights=None,
                                            init_weights=False)
    plain.load_state_dict(state)
    with pytest.MonkeyPatch.context() as patch:  # the same wrapper around torchvision's own blocks
        patch.setattr(fid, "fid_inception_v3", lambda: plain)
        plain_network = fid.InceptionV3([3], resize_input=True, normalize_input=True).eval()
    assert type(plain_network.blocks[3][2]) is torchvision.models.inception.InceptionE
    return torch, state, network, plain_network


@pytest.fixture(scope="module")
def dew_features(reference, tmp_path_factory):
    _, state, _, _ = reference
    path = tmp_path_factory.mktemp("inception") / "pt_inception-random.npz"
    np.savez(path, **{name: value.numpy() for name, value in state.items()})
    return InceptionFeatures(path)


def _images(size: int) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 256, (3, size, size, 3), dtype=np.uint8)


def _pool3(torch, network, images: np.ndarray) -> np.ndarray:
    """pytorch-fid's input convention: float [0, 1], NCHW."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    with torch.no_grad():
        (out,) = network(x)
    assert out.shape == (len(images), 2048, 1, 1)
    return out[:, :, 0, 0].numpy()


def _relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# 299: the resize is the identity on both sides; 32 (CIFAR-10) and 400: bilinear up- and downsampling
@pytest.mark.parametrize("size", [299, 32, 400])
def test_dew_matches_pytorch_fid_pool3_features(reference, dew_features, size):
    torch, _, network, _ = reference
    images = _images(size)
    want = _pool3(torch, network, images)
    got = dew_features(images)
    assert got.shape == want.shape == (3, 2048)
    assert np.std(want) > 0.1 * np.max(np.abs(want))  # features that vary, not a constant
    assert _relative_difference(got, want) <= TOLERANCE


def _with_blocks(network, torchvision, blocks):
    """A copy of pytorch-fid's network whose listed FID blocks run torchvision's forward instead."""
    network = copy.deepcopy(network)
    modules = dict(network.named_modules())
    parents = {"Mixed_5b": "blocks.2.0", "Mixed_5c": "blocks.2.1", "Mixed_5d": "blocks.2.2",
               "Mixed_6b": "blocks.2.4", "Mixed_6c": "blocks.2.5", "Mixed_6d": "blocks.2.6",
               "Mixed_6e": "blocks.2.7", "Mixed_7b": "blocks.3.1", "Mixed_7c": "blocks.3.2"}
    for block in blocks:
        module = modules[parents[block]]
        module.__class__ = module.__class__.__bases__[0]  # FIDInceptionA -> torchvision's InceptionA
        assert module.__class__.__module__ == "torchvision.models.inception"
    return network


@pytest.mark.parametrize(
    "control",
    [
        "torchvision blocks",  # all three FID differences at once
        "pools count the padding",  # A, C and the first E average over padded zeros
        "Mixed_7c averages",  # the last block pools with an average instead of a max
    ],
)
def test_torchvisions_blocks_on_the_same_weights_are_far_from_dew(reference, dew_features, control):
    torch, state, network, plain_network = reference
    _, torchvision = _torchvision()
    if control == "torchvision blocks":
        other = plain_network
    elif control == "pools count the padding":
        other = _with_blocks(network, torchvision, ["Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6b",
                                                    "Mixed_6c", "Mixed_6d", "Mixed_6e", "Mixed_7b"])
    else:
        other = _with_blocks(network, torchvision, ["Mixed_7c"])
    images = _images(299)
    got = dew_features(images)
    assert _relative_difference(got, _pool3(torch, network, images)) <= TOLERANCE
    assert _relative_difference(got, _pool3(torch, other, images)) > 100 * TOLERANCE
