"""A published decoder with a LoRA adapter, and PEFT adapter directories in and out of Dew.

`adapt(pretrained, lora, key=)` resolves the adapter's ``modules`` (Hugging Face module names)
through the family's weight table to Dew kernel paths, draws fresh factors or reads a PEFT
adapter's, and returns an `AdaptedDecoder`: its ``variables`` are ``{"params": factors, "base":
the frozen weights}``, so an objective built from it trains the factors alone. ``save_adapter``
writes PEFT's layout (adapter_config.json, adapter_model.safetensors with
``base_model.model.<module>.lora_A.weight [rank, in]`` and ``lora_B.weight [out, rank]``), which
``peft.PeftModel.from_pretrained`` loads onto the transformers model of the same base.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.core import meta

from dew.files import staged_directory
from dew.interop import families
from dew.interop.safetensors_io import SafetensorsFile, save_file
from dew.nn.adapters import CONFIG_FILE, WEIGHTS_FILE, LoRA, LoRADecoder, factor_path

PEFT_PREFIX = "base_model.model."  # what PeftModelForCausalLM puts before a module's name
HEAD = "lm_head"


@dataclasses.dataclass(frozen=True)
class Projection:
    """One linear module of the base: its Hugging Face name, its kernel path in the model's own
    layout, the layer index within a stacked kernel (None when not stacked) and its ``(in, out)``."""

    name: str
    kernel: str
    layer: int | None
    shape: tuple[int, int]


def linear_modules(family: Any, model: Any, params: Mapping[str, Any]) -> dict[str, Projection]:
    """Every linear module the model has, by Hugging Face module name, from the family's table."""
    flat = traverse_util.flatten_dict(dict(meta.unbox(params)), sep="/")
    found = {}
    for weight in family.WEIGHTS:
        if not weight.transpose:
            continue
        layered = "{i}" in weight.dew
        for i in range(model.num_layers) if layered else [None]:
            dew = weight.dew.format(i=i) if layered else weight.dew
            name = (weight.hf.format(i=i) if layered else weight.hf).removesuffix(".weight")
            stacked = layered and getattr(model, "scan_layers", False)
            path = "layers/" + dew.split("/", 1)[1] if stacked else dew
            if path in flat:
                shape = tuple(np.shape(flat[path]))[-2:]
                found[name] = Projection(name, path, i if stacked else None, shape)
    return found


def projection_names(family: Any) -> list[str]:
    """The short names of the family's linear modules (q_proj, ..., down_proj, lm_head)."""
    return sorted({w.hf.removesuffix(".weight").rsplit(".", 1)[-1] for w in family.WEIGHTS if w.transpose})


def select(lora: LoRA, family: Any, modules: Mapping[str, Projection]) -> list[Projection]:
    """The projections ``lora.modules`` names, raising on a name that matches nothing."""
    all_linear = [name for name in modules if name.rsplit(".", 1)[-1] != HEAD]
    chosen = [p for name, p in modules.items() if lora.selects(name, all_linear)]
    known = projection_names(family)
    if isinstance(lora.modules, tuple):
        for entry in lora.modules:
            if not any(name == entry or name.endswith("." + entry) for name in modules):
                why = ("is not a projection name" if entry.rsplit(".", 1)[-1] not in known
                       else "matches no module of this model")
                raise ValueError(
                    f"LoRA modules entry {entry!r} {why}; the {family.MODEL_TYPE} projections are {known} "
                    f"(this model has {sorted({n.rsplit('.', 1)[-1] for n in modules})})"
                )
    if not chosen:
        raise ValueError(
            f"LoRA modules={lora.modules!r} matches no linear module of this {family.MODEL_TYPE} model; "
            f"module names look like {next(iter(modules))!r}, and the projections are {known}"
        )
    for projection in chosen:
        if lora.rank > min(projection.shape):
            raise ValueError(
                f"LoRA rank={lora.rank} is larger than the projection {projection.name} "
                f"([in, out] = {list(projection.shape)}); use rank <= {min(projection.shape)}"
            )
    return chosen


def _targets(chosen: list[Projection], modules: Mapping[str, Projection], model: Any) -> tuple[str, ...]:
    """The adapted kernel paths; a stacked kernel must be adapted in every layer or none."""
    targets: dict[str, set] = {}
    for projection in chosen:
        targets.setdefault(projection.kernel, set()).add(projection.layer)
    for kernel, layers in targets.items():
        if None not in layers and len(layers) != model.num_layers:
            raise ValueError(
                f"the adapter covers {kernel} in layers {sorted(layers)} only, but a model with "
                "scan_layers=True holds one stacked kernel for all layers; load the base with "
                "scan_layers=False to adapt some layers only"
            )
    return tuple(targets)


def _as_key(key: Any) -> jax.Array:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jax.random.key(int(key))
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    raise TypeError(f"key must be an int seed or a jax.random.key(...); got {key!r}")


def _same_base(adapter_base: str, source: str) -> bool:
    """Whether two names of a base agree: equal, or the same final path component (a Hub id
    ``Org/Model`` and a local directory ``.../Model`` both name the model ``Model``)."""
    a, b = str(adapter_base).rstrip("/"), str(source).rstrip("/")
    return a == b or Path(a).name == Path(b).name


def _read_factors(lora: LoRA, chosen: list[Projection], targets: tuple[str, ...],
                  model: Any) -> dict[str, Any]:
    """The factors of the PEFT adapter in ``lora.weights``, in Dew's layout, checked against the base."""
    path = Path(lora.weights) / WEIGHTS_FILE
    tensors = SafetensorsFile(path)
    expected = {}
    for p in chosen:
        expected[f"{PEFT_PREFIX}{p.name}.lora_A.weight"] = (p, "lora_A", (lora.rank, p.shape[0]))
        expected[f"{PEFT_PREFIX}{p.name}.lora_B.weight"] = (p, "lora_B", (p.shape[1], lora.rank))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = [f"{label} {names[:4]}" + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                 for label, names in (("lacks tensors", missing), ("has tensors this base does not take", unexpected))
                 if names]
        raise ValueError(
            f"the adapter in {lora.weights} does not fit this base: it {'; it '.join(parts)}. It was "
            f"made for {lora.base or 'another model'} with target_modules={lora.modules!r}"
        )
    flat: dict[str, Any] = {}
    for name, (projection, factor, shape) in expected.items():
        found = tensors.shape(name)
        if found != shape:
            raise ValueError(
                f"adapter tensor {name!r} in {path} has shape {list(found)}, but this base's "
                f"{projection.name} ([in, out] = {list(projection.shape)}) at rank {lora.rank} needs "
                f"{list(shape)}; the adapter was made for another base ({lora.base or 'unnamed'})"
            )
        array = np.asarray(tensors[name], dtype=np.float32).T  # PEFT stores [out, in]
        key = f"{factor_path(projection.kernel)}/{factor}"
        if projection.layer is None:
            flat[key] = array
        else:
            flat.setdefault(key, [None] * model.num_layers)[projection.layer] = array
    flat = {k: jnp.asarray(np.stack(v) if isinstance(v, list) else v) for k, v in flat.items()}
    return traverse_util.unflatten_dict(flat, sep="/")


def _fresh_factors(lora: LoRA, targets: tuple[str, ...], params: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
    flat = traverse_util.flatten_dict(dict(meta.unbox(params)), sep="/")
    factors = {}
    for index, path in enumerate(targets):
        a, b = lora.init_factors(jax.random.fold_in(key, index), flat[path])
        factors[f"{factor_path(path)}/lora_A"] = a
        factors[f"{factor_path(path)}/lora_B"] = b
    return traverse_util.unflatten_dict(factors, sep="/")


def adapt(pretrained: Any, lora: LoRA, *, key: Any = None) -> "AdaptedDecoder":
    """``pretrained`` (a PretrainedDecoder) with the adapter ``lora``: fresh factors drawn from
    ``key``, or a PEFT adapter's factors when ``lora`` came from `LoRA.load` (no key needed)."""
    if not isinstance(lora, LoRA):
        raise TypeError(f"adapt takes a dew.nn.adapters.LoRA; got {type(lora).__name__}")
    if key is None and lora.weights is None:
        raise ValueError("adapt draws fresh adapter factors, which needs key= (an int seed or a jax.random.key)")
    key = None if key is None else _as_key(key)
    family = families.decoder_family(dict(pretrained.config), "the bundle's config")
    if lora.base is not None and pretrained.source is not None and not _same_base(lora.base, pretrained.source):
        raise ValueError(
            f"the adapter was made for base {lora.base!r}, but this base was loaded from "
            f"{pretrained.source!r}; adapt the base the adapter names, or, if this is the same model "
            "under another name, load the adapter with LoRA.load(directory, check_base=False)"
        )
    params = pretrained.variables["params"]
    modules = linear_modules(family, pretrained.model, params)
    chosen = select(lora, family, modules)
    targets = _targets(chosen, modules, pretrained.model)
    recorded = dataclasses.replace(lora, weights=None)  # the factors live in the variables from here on
    model = LoRADecoder(pretrained.model, recorded, targets, base=pretrained.source)
    if lora.weights is not None:
        factors = _read_factors(lora, chosen, targets, pretrained.model)
    else:
        factors = _fresh_factors(lora, targets, params, key)
    return AdaptedDecoder(model=model, variables={"params": factors, "base": meta.unbox(params)},
                          base=pretrained, modules=tuple(chosen))


def restore(pretrained: Any, model: LoRADecoder, factors: Mapping[str, Any]) -> "AdaptedDecoder":
    """The adapted bundle of a saved run: ``pretrained`` (the base the run's ``model`` names,
    loaded again) with the run's trained ``factors``, checked against the adapter's layout."""
    fresh = adapt(pretrained, dataclasses.replace(model.lora, base=None), key=0)  # factors replaced below
    if fresh.model.targets != model.targets:
        raise ValueError(
            f"the run adapts kernels {list(model.targets)[:4]}, but its adapter settings select "
            f"{list(fresh.model.targets)[:4]} on the base {model.base!r}; the base changed since the run"
        )
    factors = fresh._factors({"params": factors})
    return dataclasses.replace(fresh, variables={"params": factors, "base": fresh.variables["base"]})


@dataclasses.dataclass(frozen=True, eq=False)
class AdaptedDecoder:
    """A PretrainedDecoder with a LoRA adapter.

    Attributes:
      model: the `LoRADecoder` (the base's CausalTransformer with the adapter).
      variables: ``{"params": factors, "base": the base's params}``; pass the bundle to an
        objective (``LMObjective(adapted, seq_len=...)``) to train the factors alone.
      base: the PretrainedDecoder adapted (its tokenizer, config and generation defaults).
      modules: the adapted projections, by Hugging Face module name.
    """

    model: LoRADecoder
    variables: Mapping[str, Any]
    base: Any
    modules: tuple[Projection, ...]

    @property
    def lora(self) -> LoRA:
        return self.model.lora

    @property
    def tokenizer(self) -> Any:
        return self.base.tokenizer

    @property
    def config(self) -> Mapping[str, Any]:
        return self.base.config

    @property
    def generation_config(self) -> Mapping[str, Any] | None:
        return self.base.generation_config

    def adapt(self, lora: LoRA, *, key: Any = None) -> "AdaptedDecoder":
        raise ValueError(
            "this model already carries a LoRA adapter; fold it in with .merge() first, then adapt "
            "the merged bundle (adapted.merge().adapt(lora, key=...))"
        )

    def _factors(self, variables: Mapping[str, Any] | None) -> Mapping[str, Any]:
        variables = self.variables if variables is None else variables
        if not isinstance(variables, Mapping) or "params" not in variables:
            got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
            raise ValueError(f"variables must hold the factors under 'params' (state.variables); got {got}")
        factors = traverse_util.flatten_dict(dict(meta.unbox(variables["params"])), sep="/")
        own = traverse_util.flatten_dict(dict(self.variables["params"]), sep="/")
        if set(factors) != set(own) or any(np.shape(factors[k]) != np.shape(own[k]) for k in own):
            raise ValueError(
                f"variables hold factors {sorted(factors)[:4]}, but this adapter has {sorted(own)[:4]} "
                "(with other shapes or names); pass the variables trained from this bundle"
            )
        return traverse_util.unflatten_dict(factors, sep="/")

    def merge(self, variables: Mapping[str, Any] | None = None) -> Any:
        """A PretrainedDecoder of the base with the factors (the bundle's, or those of
        ``variables`` such as a trained ``state.variables``) folded into its kernels."""
        factors = self._factors(variables)
        merged = self.model.merge({"params": factors, "base": self.variables["base"]})
        return dataclasses.replace(self.base, variables=merged)

    def text_generation(self, sampling: Any = None, variables: Mapping[str, Any] | None = None) -> Any:
        """A TextGeneration task over the merged weights, with the base's tokenizer and defaults."""
        return self.merge(variables).text_generation(sampling)

    def save_adapter(self, directory: str | Path, variables: Mapping[str, Any] | None = None, *,
                     overwrite: bool = False) -> Path:
        """Write the adapter as PEFT does: adapter_config.json and adapter_model.safetensors.

        ``variables`` (default: the bundle's) hold the factors to write, such as a trained
        ``state.variables``. A non-empty ``directory`` is replaced only with ``overwrite=True``;
        the files appear together or not at all.
        """
        dest = Path(directory).expanduser()
        if dest.exists() and not dest.is_dir():
            raise FileExistsError(f"{dest} exists and is not a directory; choose another destination")
        if dest.is_dir() and any(dest.iterdir()) and not overwrite:
            raise FileExistsError(f"{dest} is not empty; pass overwrite=True to replace it or choose an empty directory")
        flat = traverse_util.flatten_dict(dict(jax.device_get(self._factors(variables))), sep="/")
        tensors = {}
        for projection in self.modules:
            for factor in ("lora_A", "lora_B"):
                array = np.asarray(flat[f"{factor_path(projection.kernel)}/{factor}"], np.float32)
                if projection.layer is not None:
                    array = array[projection.layer]
                tensors[f"{PEFT_PREFIX}{projection.name}.{factor}.weight"] = np.ascontiguousarray(array.T)
        config = self.lora.peft_config(self.base.source, self._target_modules())
        with staged_directory(dest) as staging:
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_file(tensors, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        return dest

    def _target_modules(self) -> list[str]:
        """PEFT's target_modules: a short name (``q_proj``) where every module of that name is
        adapted, the full module names otherwise."""
        family = families.decoder_family(dict(self.config), "the bundle's config")
        every = linear_modules(family, self.model.model, self.variables["base"])
        chosen = {p.name for p in self.modules}
        names = []
        for short in sorted({name.rsplit(".", 1)[-1] for name in chosen}):
            instances = {name for name in every if name.rsplit(".", 1)[-1] == short}
            names += [short] if instances <= chosen else sorted(instances & chosen)
        return names
