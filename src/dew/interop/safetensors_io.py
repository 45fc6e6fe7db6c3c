"""Read and write safetensors files, single or sharded, as NumPy arrays.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian header length,
a JSON header mapping each tensor name to ``{"dtype", "shape", "data_offsets"}``, then the raw
little-endian bytes. Reading memory-maps the file, so a tensor is only read when it is used.
bfloat16 and float8 tensors come back as ml_dtypes arrays (the dtypes JAX itself uses), which
NumPy alone cannot represent.

A sharded checkpoint has ``model.safetensors.index.json`` whose ``weight_map`` names the file
holding each tensor; `open_checkpoint` reads either layout through one mapping.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# diffusers names a model's weights by this stem: <stem>.safetensors or <stem>.safetensors.index.json
DIFFUSERS_STEM = "diffusion_pytorch_model"
DIFFUSERS_FILE = f"{DIFFUSERS_STEM}.safetensors"
DIFFUSERS_INDEX = f"{DIFFUSERS_STEM}.safetensors.index.json"

_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(dtype): name for name, dtype in _DTYPES.items()}


class SafetensorsFile(Mapping):
    """The tensors of one safetensors file, read lazily: ``file[name]`` is a NumPy array."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        if data.size < 8:
            raise ValueError(f"{self.path} is not a safetensors file: it has only {data.size} bytes")
        (header_len,) = struct.unpack("<Q", data[:8].tobytes())
        if 8 + header_len > data.size:
            raise ValueError(
                f"{self.path} is not a safetensors file or is truncated: its header claims "
                f"{header_len} bytes but the file has {data.size}"
            )
        header = json.loads(data[8: 8 + header_len].tobytes())
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._header: dict[str, dict[str, Any]] = header
        self._data = data[8 + header_len:]

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._header[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(
                f"tensor {name!r} in {self.path} has dtype {entry['dtype']}, which Dew cannot read; "
                f"readable dtypes are {sorted(_DTYPES)}"
            )
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        shape = tuple(int(d) for d in entry["shape"])
        start, end = (int(offset) for offset in entry["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - start != expected or end > self._data.size:
            raise ValueError(
                f"tensor {name!r} in {self.path} is damaged: shape {shape} of {entry['dtype']} needs "
                f"{expected} bytes, its offsets [{start}, {end}) span {end - start} of a "
                f"{self._data.size}-byte data section. Re-download or re-save the checkpoint."
            )
        return np.frombuffer(self._data, dtype=dtype, count=expected // dtype.itemsize,
                             offset=start).reshape(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._header[name]["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._header)

    def __len__(self) -> int:
        return len(self._header)


class Checkpoint(Mapping):
    """All tensors of a checkpoint directory (one file or a sharded index), by name."""

    def __init__(self, files: Mapping[str, SafetensorsFile]):
        self._files = dict(files)  # tensor name -> the file that holds it

    def __getitem__(self, name: str) -> np.ndarray:
        return self._files[name][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[name].shape(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def open_checkpoint(directory: str | Path, *, stem: str = "model") -> Checkpoint:
    """The weights in ``directory``: model.safetensors, or the shards model.safetensors.index.json lists.

    ``stem`` names the files: diffusers' models use "diffusion_pytorch_model".
    """
    directory = Path(directory)
    index_path = directory / f"{stem}.safetensors.index.json"
    single_path = directory / f"{stem}.safetensors"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map' naming the file of each tensor")
        shards: dict[str, SafetensorsFile] = {}
        files: dict[str, SafetensorsFile] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                shard_path = directory / shard
                if not shard_path.is_file():
                    raise FileNotFoundError(
                        f"{index_path} puts tensor {name!r} in {shard}, but {shard_path} does not "
                        "exist; download every shard the index lists"
                    )
                shards[shard] = SafetensorsFile(shard_path)
            if name not in shards[shard]:
                raise ValueError(f"{index_path} puts tensor {name!r} in {shard}, but that file does not hold it")
            files[name] = shards[shard]
        return Checkpoint(files)
    if single_path.is_file():
        file = SafetensorsFile(single_path)
        return Checkpoint({name: file for name in file})
    present = sorted(path.name for path in directory.iterdir())[:12] if directory.is_dir() else []
    raise FileNotFoundError(
        f"no weights in {directory}: expected {single_path.name} or {index_path.name} (with its shards); "
        f"the directory holds {present}. Dew reads only safetensors weights: convert a "
        "pytorch_model.bin with transformers' save_pretrained(..., safe_serialization=True)"
    )


def save_file(tensors: Mapping[str, np.ndarray], path: str | Path,
              metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (name -> array) to one safetensors file, in name order."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype.byteorder == ">":  # safetensors stores little-endian bytes
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot store")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for array in arrays:
            out.write(array.tobytes())
    return path
