"""A published decoder with a LoRA adapter, and PEFT adapter directories in and out of Dew.

`adapt(pretrained, lora, key=)` resolves the adapter's ``modules`` (Hugging Face module names)
through the family's weight table to Dew kernel paths, draws fresh factors or reads a PEFT
adapter's, and returns an `AdaptedDecoder`: its ``variables`` are ``{"params": factors, "base":
the frozen weights}``, so an objective built from it trains the factors alone. ``save_adapter``
writes PEFT's layout (adapter_config.json, adapter_model.safetensors with
``base_model.model.<module>.lora_A.weight [rank, in]`` and ``lora_B.weight [out, rank]``), which
``peft.PeftModel.from_pretrained`` loads onto the transformers model of the same base.

Expert parameters (PEFT's ``target_parameters``) are stored as PEFT's ``ParamWrapper`` stores
them: ``lora_A.weight [rank * experts, in]`` (expert-major rows) and ``lora_B.weight [out, rank *
experts]`` (expert-minor columns), under the experts module's name; when several parameters of one
module are adapted, each earlier one sits one ``.base_layer`` deeper.
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
from dew.nn.adapters import CONFIG_FILE, WEIGHTS_FILE, LoRA, LoRADecoder, factor_path, model_collections

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
    """Every linear module the model has, by Hugging Face module name, from the family's table.

    A mixture's router and experts are parameters of one module on both sides (transformers holds
    each layer's experts as stacked ``gate_up_proj`` / ``down_proj`` tensors), not linear modules:
    PEFT reaches them with ``target_parameters``, and so does `expert_parameters`."""
    flat = traverse_util.flatten_dict(dict(meta.unbox(params)), sep="/")
    found = {}
    for weight in family.WEIGHTS:
        if not weight.transpose or not weight.dew.endswith("/kernel"):
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


@dataclasses.dataclass(frozen=True)
class ExpertParameter:
    """One stacked expert parameter of the base: its Hugging Face name, where its factors live in
    Dew's layout, the expert kernels its update is split over, the layer index within stacked
    kernels (None when not stacked), ``(experts, in, out)``, and its position among its module's
    parameters (PEFT wraps them in that order)."""

    name: str
    factors: str
    kernels: tuple[str, ...]
    layer: int | None
    shape: tuple[int, int, int]
    order: int

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def expert_parameters(family: Any, model: Any, params: Mapping[str, Any]) -> dict[str, ExpertParameter]:
    """Every stacked expert parameter the model has, by Hugging Face name, from the family's
    EXPERT_PARAMETERS (none for a family without mixture layers)."""
    flat = traverse_util.flatten_dict(dict(meta.unbox(params)), sep="/")
    stacked = getattr(model, "scan_layers", False)
    found = {}
    for i in range(model.num_layers):
        for order, (suffix, kernels) in enumerate(getattr(family, "EXPERT_PARAMETERS", {}).items()):
            folder = "layers/mlp/experts" if stacked else f"layers_{i}/mlp/experts"
            paths = tuple(f"{folder}/{kernel}" for kernel in kernels)
            if not all(path in flat for path in paths):
                continue  # a dense layer
            experts, fan_in, _ = np.shape(flat[paths[0]])[-3:]
            width = sum(np.shape(flat[path])[-1] for path in paths)
            name = f"model.layers.{i}.{suffix}"
            found[name] = ExpertParameter(name, f"{folder}/{suffix.rsplit('.', 1)[-1]}", paths,
                                          i if stacked else None, (experts, fan_in, width), order)
    return found


def select_parameters(lora: LoRA, family: Any, parameters: Mapping[str, ExpertParameter]) -> list[ExpertParameter]:
    """The expert parameters ``lora.parameters`` names, raising on a name that matches nothing."""
    known = sorted(getattr(family, "EXPERT_PARAMETERS", {}))
    for entry in lora.parameters:
        if not any(name == entry or name.endswith("." + entry) for name in parameters):
            if not known:
                why = f"the {family.MODEL_TYPE} family has no stacked expert parameters"
            elif not parameters:
                why = "this model has no mixture layers"
            else:
                why = f"it matches none of this model's, which are named like {next(iter(parameters))!r}"
            raise ValueError(f"LoRA parameters entry {entry!r} adapts nothing: {why} (expert parameters: {known})")
    chosen = [p for name, p in parameters.items() if lora.selects_parameter(name)]
    for parameter in chosen:
        if lora.rank > min(parameter.shape[1:]):
            raise ValueError(
                f"LoRA rank={lora.rank} is larger than the expert parameter {parameter.name} "
                f"([experts, in, out] = {list(parameter.shape)}); use rank <= {min(parameter.shape[1:])}"
            )
    return chosen


def projection_names(family: Any) -> list[str]:
    """The short names of the family's linear modules (q_proj, ..., down_proj, lm_head)."""
    return sorted({w.hf.removesuffix(".weight").rsplit(".", 1)[-1] for w in family.WEIGHTS if w.transpose})


def select(lora: LoRA, family: Any, modules: Mapping[str, Projection]) -> list[Projection]:
    """The projections ``lora.modules`` names, raising on a name that matches nothing."""
    if lora.modules == ():
        return []  # the adapter covers expert parameters only
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
    return tuple(_whole_stacks([(p.kernel, p.layer) for p in chosen], model))


def _expert_targets(chosen: list[ExpertParameter], model: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """LoRADecoder's ``experts``: (factor path, kernels) per adapted expert parameter."""
    kernels = {p.factors: p.kernels for p in chosen}
    return tuple((path, kernels[path]) for path in _whole_stacks([(p.factors, p.layer) for p in chosen], model))


def _whole_stacks(paths: list[tuple[str, int | None]], model: Any) -> dict[str, set]:
    """The paths with the layers each covers; a stacked path must cover every layer or none."""
    targets: dict[str, set] = {}
    for path, layer in paths:
        targets.setdefault(path, set()).add(layer)
    for kernel, layers in targets.items():
        if None not in layers and len(layers) != model.num_layers:
            raise ValueError(
                f"the adapter covers {kernel} in layers {sorted(layers)} only, but a model with "
                "scan_layers=True holds one stacked kernel for all layers; load the base with "
                "scan_layers=False to adapt some layers only"
            )
    return targets


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


def _peft_names(parameter: ExpertParameter, chosen: list[ExpertParameter]) -> tuple[str, str]:
    """PEFT's tensor names for an expert parameter's factors: under its module, one
    ``.base_layer`` deeper for each parameter of that module adapted after it."""
    later = sum(1 for p in chosen if p.module == parameter.module and p.order > parameter.order)
    stem = f"{PEFT_PREFIX}{parameter.module}" + ".base_layer" * later
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


def _experts_from_peft(a: np.ndarray, b: np.ndarray, experts: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's ``[rank * experts, in]`` (row e * rank + k) and ``[out, rank * experts]`` (column
    k * experts + e) as Dew's ``A [experts, in, rank]`` and ``B [experts, rank, out]``."""
    return (a.reshape(experts, rank, a.shape[-1]).transpose(0, 2, 1),
            b.reshape(b.shape[0], rank, experts).transpose(2, 1, 0))


def _experts_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `_experts_from_peft`."""
    experts, fan_in, rank = a.shape
    return (a.transpose(0, 2, 1).reshape(experts * rank, fan_in),
            b.transpose(2, 1, 0).reshape(b.shape[-1], rank * experts))


def _read_factors(lora: LoRA, chosen: list[Projection], parameters: list[ExpertParameter],
                  model: Any) -> dict[str, Any]:
    """The factors of the PEFT adapter in ``lora.weights``, in Dew's layout, checked against the base."""
    path = Path(lora.weights) / WEIGHTS_FILE
    tensors = SafetensorsFile(path)
    expected = {}
    for p in chosen:
        expected[f"{PEFT_PREFIX}{p.name}.lora_A.weight"] = (p, "lora_A", (lora.rank, p.shape[0]))
        expected[f"{PEFT_PREFIX}{p.name}.lora_B.weight"] = (p, "lora_B", (p.shape[1], lora.rank))
    for p in parameters:
        experts, fan_in, fan_out = p.shape
        a, b = _peft_names(p, parameters)
        expected[a] = (p, "lora_A", (lora.rank * experts, fan_in))
        expected[b] = (p, "lora_B", (fan_out, lora.rank * experts))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = [f"{label} {names[:4]}" + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                 for label, names in (("lacks tensors", missing), ("has tensors this base does not take", unexpected))
                 if names]
        raise ValueError(
            f"the adapter in {lora.weights} does not fit this base: it {'; it '.join(parts)}. It was "
            f"made for {lora.base or 'another model'} with target_modules={lora.modules!r}"
            + (f" and target_parameters={lora.parameters!r}" if lora.parameters else "")
        )
    read: dict[str, np.ndarray] = {}
    for name, (owner, factor, shape) in expected.items():
        found = tensors.shape(name)
        if found != shape:
            kind = "[in, out]" if isinstance(owner, Projection) else "[experts, in, out]"
            raise ValueError(
                f"adapter tensor {name!r} in {path} has shape {list(found)}, but this base's "
                f"{owner.name} ({kind} = {list(owner.shape)}) at rank {lora.rank} needs "
                f"{list(shape)}; the adapter was made for another base ({lora.base or 'unnamed'})"
            )
        read[name] = np.asarray(tensors[name], dtype=np.float32)
    flat: dict[str, Any] = {}

    def place(key: str, layer: int | None, array: np.ndarray) -> None:
        if layer is None:
            flat[key] = array
        else:
            flat.setdefault(key, [None] * model.num_layers)[layer] = array

    for p in chosen:
        for factor in ("lora_A", "lora_B"):
            place(f"{factor_path(p.kernel)}/{factor}", p.layer, read[f"{PEFT_PREFIX}{p.name}.{factor}.weight"].T)
    for p in parameters:
        a_name, b_name = _peft_names(p, parameters)
        a, b = _experts_from_peft(read[a_name], read[b_name], p.shape[0], lora.rank)
        place(f"{p.factors}/lora_A", p.layer, a)
        place(f"{p.factors}/lora_B", p.layer, b)
    flat = {k: jnp.asarray(np.stack(v) if isinstance(v, list) else v) for k, v in flat.items()}
    return traverse_util.unflatten_dict(flat, sep="/")


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
    parameters = select_parameters(lora, family, expert_parameters(family, pretrained.model, params))
    recorded = dataclasses.replace(lora, weights=None)  # the factors live in the variables from here on
    model = LoRADecoder(pretrained.model, recorded, _targets(chosen, modules, pretrained.model), base=pretrained.source,
                        experts=_expert_targets(parameters, pretrained.model))
    if lora.weights is not None:
        factors = _read_factors(lora, chosen, parameters, pretrained.model)
    else:
        factors = model.init_factors(meta.unbox(params), key)
    others = model_collections(pretrained.variables)  # the routers' balancing bias, say
    return AdaptedDecoder(model=model, variables={**others, "params": factors, "base": meta.unbox(params)},
                          base=pretrained, modules=tuple(chosen), parameters=tuple(parameters))


def restore(pretrained: Any, model: LoRADecoder, factors: Mapping[str, Any]) -> "AdaptedDecoder":
    """The adapted bundle of a saved run: ``pretrained`` (the base the run's ``model`` names,
    loaded again) with the run's trained ``factors``, checked against the adapter's layout."""
    fresh = adapt(pretrained, dataclasses.replace(model.lora, base=None), key=0)  # factors replaced below
    if fresh.model.targets != model.targets or fresh.model.experts != model.experts:
        raise ValueError(
            f"the run adapts kernels {list(model.targets + model.experts)[:4]}, but its adapter settings select "
            f"{list(fresh.model.targets + fresh.model.experts)[:4]} on the base {model.base!r}; the base changed "
            "since the run"
        )
    factors = fresh._factors({"params": factors})
    return dataclasses.replace(fresh, variables={**fresh.variables, "params": factors})


@dataclasses.dataclass(frozen=True, eq=False)
class AdaptedDecoder:
    """A PretrainedDecoder with a LoRA adapter.

    Attributes:
      model: the `LoRADecoder` (the base's CausalTransformer with the adapter).
      variables: ``{"params": factors, "base": the base's params}``; pass the bundle to an
        objective (``LMObjective(adapted, seq_len=...)``) to train the factors alone.
      base: the PretrainedDecoder adapted (its tokenizer, config and generation defaults).
      modules: the adapted projections, by Hugging Face module name.
      parameters: the adapted stacked expert parameters, by Hugging Face parameter name.
    """

    model: LoRADecoder
    variables: Mapping[str, Any]
    base: Any
    modules: tuple[Projection, ...]
    parameters: tuple[ExpertParameter, ...] = ()

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
        others = model_collections(self.variables if variables is None else {**self.variables, **variables})
        merged = self.model.merge({**others, "params": factors, "base": self.variables["base"]})
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
        for parameter in self.parameters:
            a, b = (np.asarray(flat[f"{parameter.factors}/{factor}"], np.float32) for factor in ("lora_A", "lora_B"))
            if parameter.layer is not None:
                a, b = a[parameter.layer], b[parameter.layer]
            for name, array in zip(_peft_names(parameter, list(self.parameters)), _experts_to_peft(a, b)):
                tensors[name] = np.ascontiguousarray(array)
        config = self.lora.peft_config(self.base.source, self._target_modules(), self._target_parameters())
        with staged_directory(dest) as staging:
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_file(tensors, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        return dest

    def _target_parameters(self) -> list[str]:
        """PEFT's target_parameters: ``mlp.experts.gate_up_proj`` where every layer's is adapted,
        the full parameter names otherwise."""
        family = families.decoder_family(dict(self.config), "the bundle's config")
        every = expert_parameters(family, self.model.model, self.variables["base"])
        chosen = {p.name for p in self.parameters}
        names = []
        for suffix in sorted({name.split(".", 3)[-1] for name in chosen}):
            instances = {name for name in every if name.endswith("." + suffix)}
            names += [suffix] if instances <= chosen else sorted(instances & chosen)
        return names

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
