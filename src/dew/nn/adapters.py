"""Low-rank adapters (LoRA; Hu et al. 2021, arXiv:2106.09685) on a model's linear projections.

An adapted projection computes ``y = x W + b + (alpha / rank) * dropout(x) A B``, with ``A [in, rank]``
and ``B [rank, out]``: the transposes of PEFT's ``lora_A.weight [rank, in]`` and
``lora_B.weight [out, rank]``. ``B`` starts at zero, so an adapted model starts as its base.

`LoRA` holds the adapter's settings. `LoRADecoder` wraps a decoder so that its variables are
``{"params": factors, "base": frozen weights}``: a trainer differentiates and optimizes
``"params"`` only, so the base gets no gradient and no optimizer state, and may be stored in
bfloat16 while the factors stay float32. The base module itself is not changed: the low-rank path
is added to the output of every adapted ``nn.Dense`` by a Flax method interceptor, which reads the
factors from a ``"lora"`` collection laid out like the params. A model with ``scan_layers=True``
stacks its layers inside ``nn.scan``, which the interceptor cannot see into, so there the
factors are folded into the kernels (``W + (alpha / rank) A B``) before the forward pass instead.

A mixture's experts are stacked parameters, not ``nn.Dense`` modules, on both sides: PEFT adapts
them with ``target_parameters`` (one ``A [experts, in, rank]``, ``B [experts, rank, out]`` pair per
stacked parameter), and so does `LoRA(parameters=...)`. Their factors are always folded into the
expert kernels before the forward pass; a fused parameter such as transformers' ``gate_up_proj``
splits its update along the output axis over Dew's ``gate_proj`` and ``up_proj`` kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.core import meta

from dew.checks import count

INITS = ("kaiming", "gaussian")
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT LoraConfig options Dew does not implement, with the values that leave each off.
UNSUPPORTED_PEFT_OPTIONS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, ()),
    "layers_to_transform": (None, ()),
    "layers_pattern": (None, ()),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "exclude_modules": (None, ()),
    "layer_replication": (None, ()),
    "trainable_token_indices": (None, ()),
    "alora_invocation_tokens": (None, ()),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "megatron_config": (None, {}),
    "arrow_config": (None, {}),
}
# PEFT initializations that rewrite the base weights too, so their adapters only fit a changed base.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """A low-rank adapter's settings.

    Attributes:
      rank: the inner width of each ``A B`` pair.
      alpha: the scale numerator; the low-rank path is multiplied by ``alpha / rank``
        (None: ``alpha = rank``, a scale of 1).
      dropout: dropout on the adapter's input while training (PEFT's ``lora_dropout``).
      modules: the projections to adapt by Hugging Face module name (``q_proj`` ... ``down_proj``;
        a name matches a module whose name ends with it), or one string: a regular expression
        the whole module name must match, or ``"all-linear"`` for every projection but the head.
        May be empty when `parameters` names what to adapt.
      parameters: stacked expert parameters to adapt, by Hugging Face parameter name (PEFT's
        ``target_parameters``: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``; a name
        matches a parameter whose name ends with it).
      init: ``"kaiming"`` (``A`` uniform in ``±1/sqrt(in)``, PEFT's default) or ``"gaussian"``
        (``A`` normal with std ``1/rank``); ``B`` always starts at zero.
      weights: a PEFT adapter directory whose trained factors `adapt` loads (set by `LoRA.load`);
        None draws fresh factors.
      base: the base checkpoint the adapter was made for (``base_model_name_or_path``); adapting
        a base of another name raises. None skips the check.
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    init: str = "kaiming"
    parameters: tuple[str, ...] = ()
    weights: str | None = None
    base: str | None = None

    def __post_init__(self):
        count(self.rank, "LoRA rank")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive number (or None for alpha = rank); got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be a probability in [0, 1); got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"LoRA init must be one of {INITS}; got {self.init!r}")
        modules = self.modules
        if isinstance(modules, str):
            if modules != ALL_LINEAR:
                try:
                    re.compile(modules)
                except re.error as error:
                    raise ValueError(f"LoRA modules={modules!r} is neither a module name tuple nor a valid "
                                     f"regular expression ({error}); pass a tuple such as ('q_proj', 'v_proj')") from None
        else:
            modules = tuple(modules)
            if not all(isinstance(m, str) and m for m in modules):
                raise ValueError(f"LoRA modules must be a tuple of module names such as "
                                 f"('q_proj', 'v_proj'); got {self.modules!r}")
            object.__setattr__(self, "modules", modules)
        parameters = (self.parameters,) if isinstance(self.parameters, str) else tuple(self.parameters)
        if not all(isinstance(p, str) and p for p in parameters):
            raise ValueError(f"LoRA parameters must be a tuple of parameter names such as "
                             f"('mlp.experts.gate_up_proj',); got {self.parameters!r}")
        object.__setattr__(self, "parameters", parameters)
        if modules == () and not parameters:
            raise ValueError("LoRA adapts nothing: modules and parameters are both empty; name projections "
                             "such as modules=('q_proj', 'v_proj') or expert parameters such as "
                             "parameters=('mlp.experts.gate_up_proj',)")

    @property
    def scaling(self) -> float:
        """The factor on the low-rank path: ``alpha / rank``."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    def selects(self, module_name: str, all_linear: Sequence[str]) -> bool:
        """Whether the Hugging Face module ``module_name`` (``model.layers.0.self_attn.q_proj``) is
        adapted, by PEFT's rules: a name in the tuple matches the whole name or its last parts; a
        string is matched against the whole name; ``all-linear`` takes the names in ``all_linear``."""
        if self.modules == ALL_LINEAR:
            return module_name in all_linear
        if isinstance(self.modules, str):
            return re.fullmatch(self.modules, module_name) is not None
        return any(module_name == m or module_name.endswith("." + m) for m in self.modules)

    def selects_parameter(self, name: str) -> bool:
        """Whether the stacked parameter ``name`` (``model.layers.0.mlp.experts.gate_up_proj``) is
        adapted, by PEFT's rule for target_parameters: the whole name or its last parts."""
        return any(name == p or name.endswith("." + p) for p in self.parameters)

    def init_factors(self, key: jax.Array, kernel: jax.ShapeDtypeStruct | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Fresh float32 ``(A, B)`` for a kernel ``[..., in, out]`` (leading axes: stacked layers)."""
        *lead, fan_in, fan_out = kernel.shape
        if self.init == "kaiming":
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) of a [rank, in] weight
            a = jax.random.uniform(key, (*lead, fan_in, self.rank), jnp.float32, -bound, bound)
        else:
            a = jax.random.normal(key, (*lead, fan_in, self.rank), jnp.float32) / self.rank
        return a, jnp.zeros((*lead, self.rank, fan_out), jnp.float32)

    # --- PEFT's adapter_config.json ---------------------------------------------------------------

    @classmethod
    def load(cls, directory: str | Path, *, check_base: bool = True) -> "LoRA":
        """The settings of a PEFT LoRA adapter directory (adapter_config.json); `adapt` then reads
        its factors from adapter_model.safetensors. ``check_base=False`` loads it onto a base of
        another name (the tensor shapes are still checked).

        Raises on a PEFT option Dew does not implement (DoRA, rsLoRA, per-module ranks, ...).
        """
        directory = Path(directory).expanduser()
        path = directory / CONFIG_FILE
        if not path.is_file():
            present = sorted(p.name for p in directory.iterdir())[:12] if directory.is_dir() else "nothing"
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {directory} (it holds {present}); a PEFT adapter directory holds "
                f"{CONFIG_FILE} beside {WEIGHTS_FILE}, as PeftModel.save_pretrained writes it"
            )
        if not (directory / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(
                f"no {WEIGHTS_FILE} in {directory}; Dew reads adapter weights only as safetensors "
                "(save the adapter with safe_serialization=True)"
            )
        config = json.loads(path.read_text())
        return cls.from_peft_config(config, weights=str(directory), where=str(path), check_base=check_base)

    @classmethod
    def from_peft_config(cls, config: Mapping[str, Any], *, weights: str | None = None,
                         where: str = CONFIG_FILE, check_base: bool = True) -> "LoRA":
        """A LoRA from the fields of a PEFT ``LoraConfig`` (as adapter_config.json holds them)."""
        if not isinstance(config, Mapping):
            raise ValueError(f"{where} must hold a JSON object; got {type(config).__name__}")
        kind = config.get("peft_type", "LORA")
        if kind != "LORA":
            raise ValueError(f"{where} describes a {kind} adapter; Dew loads LoRA adapters (peft_type 'LORA')")
        task = config.get("task_type")
        if task not in (None, "CAUSAL_LM"):
            raise ValueError(f"{where} has task_type={task!r}; Dew adapts decoders (task_type 'CAUSAL_LM')")
        active = {name: config[name] for name, off in UNSUPPORTED_PEFT_OPTIONS.items()
                  if name in config and config[name] not in off}
        if active:
            raise ValueError(
                f"{where} sets {active}, which Dew's LoRA does not implement, so the adapter would "
                "compute something else here; only plain LoRA (every such option off) loads"
            )
        init = config.get("init_lora_weights", True)
        if isinstance(init, str) and init.split("_")[0].lower() in BASE_CHANGING_INITS:
            raise ValueError(
                f"{where} has init_lora_weights={init!r}, which also rewrites the base weights, so its "
                "factors only fit that rewritten base; convert it to a plain LoRA adapter with PEFT "
                "(path_initial_model_for_weight_conversion) first"
            )
        rank = config.get("r")
        targets = config.get("target_modules")
        parameters = tuple(sorted(config.get("target_parameters") or ()))
        if targets is None and not parameters:
            raise ValueError(f"{where} names no target_modules or target_parameters; Dew needs what the adapter covers")
        modules = targets if isinstance(targets, str) else tuple(sorted(targets or ()))
        return cls(
            rank=rank,
            alpha=config.get("lora_alpha", 8),
            dropout=float(config.get("lora_dropout") or 0.0),
            modules=modules,
            init="gaussian" if init == "gaussian" else "kaiming",
            parameters=parameters,
            weights=weights,
            base=config.get("base_model_name_or_path") if check_base else None,
        )

    def peft_config(self, base: str | None, targets: Sequence[str], parameters: Sequence[str] = ()) -> dict[str, Any]:
        """adapter_config.json for PEFT: ``targets`` are the module names the adapter covers,
        ``parameters`` the stacked parameter names."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": self.rank,
            "lora_alpha": self.rank if self.alpha is None else self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(targets),
            "target_parameters": sorted(parameters) or None,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_dora": False,
            "use_rslora": False,
            "init_lora_weights": "gaussian" if self.init == "gaussian" else True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "inference_mode": True,
            "revision": None,
        }


# --- the adapted model ----------------------------------------------------------------------------


def factor_path(kernel_path: str) -> str:
    """Where a kernel's factors live: ``layers_0/self_attn/q_proj/kernel`` -> ``layers_0/self_attn/q_proj``."""
    return kernel_path.rsplit("/", 1)[0]


@dataclasses.dataclass(frozen=True)
class LoRADecoder:
    """A decoder with low-rank adapters on the kernels ``targets`` (``layers_0/self_attn/q_proj/kernel``)
    and on the stacked expert parameters ``experts``.

    Its variables are ``{"params": factors, "base": the decoder's params}``, factors laid out like
    the params (``layers_0/self_attn/q_proj/lora_A``). Each entry of ``experts`` is ``(factor path,
    expert kernels)``: one ``A B`` pair at the factor path (``layers_0/mlp/experts/gate_up_proj``)
    whose update is split along the output axis over the kernels, in order
    (``layers_0/mlp/experts/gate_proj``, ``layers_0/mlp/experts/up_proj``). ``apply`` takes the decoder's arguments and
    returns what it returns; ``rngs={"dropout": key}`` turns the adapter's dropout on. ``base``
    names the checkpoint (directory or Hub id) the frozen weights come from, so a run record of
    this model references the base instead of copying it.
    """

    model: Any
    lora: LoRA
    targets: tuple[str, ...]
    base: str | None = None
    experts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    #: collections held fixed from the starting weights: a trainer neither trains nor saves them
    frozen_collections: ClassVar[tuple[str, ...]] = ("base",)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "experts", tuple((path, tuple(kernels)) for path, kernels in self.experts))
        if not self.targets and not self.experts:
            raise ValueError("LoRADecoder needs at least one kernel to adapt; targets and experts are empty")
        if self.experts and self.lora.dropout:
            raise ValueError(
                f"LoRA dropout={self.lora.dropout} cannot act on expert parameters: their factors are folded "
                "into the expert kernels, where no dropout on the adapter's input can be applied; use dropout=0"
            )
        if getattr(self.model, "scan_layers", False) and self.lora.dropout:
            raise ValueError(
                f"LoRA dropout={self.lora.dropout} needs a model with scan_layers=False: a scanned "
                "model's factors are folded into its kernels, where no dropout on the adapter's "
                "input can be applied. Load the checkpoint with scan_layers=False or use dropout=0"
            )

    # what generation and the objectives read from a decoder
    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    def init_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.init_cache(*args, **kwargs)

    def init(self, key: jax.Array, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Fresh variables: the decoder's own init as the base, fresh factors over it."""
        base_key, factor_key = jax.random.split(key)
        variables = self.model.init(base_key, *args, **kwargs)
        base = variables["params"]
        return {**variables, "params": self.init_factors(base, factor_key), "base": base}

    def init_factors(self, params: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
        """Fresh factors for the decoder's ``params``, one key per target (with the kernels' logical
        axis names where the params carry them, the rank axis unnamed)."""
        keys = _tuple_keys(params)
        flat = {name: value for name, (_, value) in keys.items()}
        self._check_targets(flat)
        pairs = [(f"{factor_path(path)}", (path,)) for path in self.targets] + list(self.experts)
        factors = {}
        for index, (where, kernels) in enumerate(pairs):
            first = flat[kernels[0]]
            *lead, fan_in, _ = meta.unbox(first).shape
            width = sum(meta.unbox(flat[k]).shape[-1] for k in kernels)
            a, b = self.lora.init_factors(jax.random.fold_in(key, index),
                                          jax.ShapeDtypeStruct((*lead, fan_in, width), jnp.float32))
            if isinstance(first, meta.Partitioned):
                names = tuple(first.names)
                a = meta.Partitioned(a, names=names[:-1] + (None,), mesh=first.mesh)
                b = meta.Partitioned(b, names=names[:-2] + (None, names[-1]), mesh=first.mesh)
            parent = keys[kernels[0]][0][:-1]  # the kernel's module, as the params tree spells it
            module = parent if "/".join(parent) == where else tuple(where.split("/"))
            factors[module + ("lora_A",)] = a
            factors[module + ("lora_B",)] = b
        return traverse_util.unflatten_dict(factors)

    def _check_targets(self, flat: Mapping[str, Any]) -> None:
        missing = [path for path in self.targets + tuple(k for _, kernels in self.experts for k in kernels)
                   if path not in flat]
        if missing:
            raise ValueError(f"the adapter targets kernels {missing[:4]} that the model does not have")

    def apply(self, variables: Mapping[str, Any], *args: Any, rngs: Any = None, **kwargs: Any) -> Any:
        """The decoder's forward pass with the adapters; takes and returns what the decoder does."""
        base, factors = _split(variables)
        others = model_collections(variables)
        if getattr(self.model, "scan_layers", False):
            merged = merge(base, factors, self.lora.scaling, self.experts)
            return self.model.apply({**others, "params": merged}, *args, **kwargs)
        if self.experts:  # expert parameters are folded; the projections get the low-rank path below
            base = merge(base, factors, self.lora.scaling, self.experts, dense=False)
        with nn.intercept_methods(self._add_low_rank_path):
            return self.model.apply({**others, "params": base, "lora": factors}, *args, rngs=rngs, **kwargs)

    def _add_low_rank_path(self, next_fun, args, kwargs, context):
        """Flax interceptor: an adapted ``nn.Dense`` returns ``x W + b + scaling * dropout(x) A B``."""
        module = context.module
        if (context.method_name != "__call__" or not isinstance(module, nn.Dense)
                or not module.has_variable("lora", "lora_A")):
            return next_fun(*args, **kwargs)
        y = next_fun(*args, **kwargs)
        x = args[0] if args else kwargs["inputs"]
        rate = self.lora.dropout
        if rate and module.has_rng("dropout"):
            keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, x.shape)
            x = jnp.where(keep, x / (1.0 - rate), 0)
        a = module.get_variable("lora", "lora_A").astype(y.dtype)
        b = module.get_variable("lora", "lora_B").astype(y.dtype)
        return y + (x.astype(y.dtype) @ a @ b) * jnp.asarray(self.lora.scaling, y.dtype)

    def base_variables(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The decoder's own variables with the adapter off: ``{"params": the frozen base}`` (and its
        other collections, such as the routers' balancing bias)."""
        return {**model_collections(variables), "params": _split(variables)[0]}

    def merge(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The decoder's own variables with the factors folded in: ``W + scaling * A B`` per target,
        in the base's dtype (so a bfloat16 base rounds the sum)."""
        base, factors = _split(variables)
        return {**model_collections(variables), "params": merge(base, factors, self.lora.scaling, self.experts)}


def model_collections(variables: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's collections beside its weights (the routers' balancing bias, which a training
    step may move): everything but the factors, the base and the adapter's own ``lora``."""
    return {name: value for name, value in variables.items() if name not in ("params", "base", "lora")}


def _split(variables: Mapping[str, Any]) -> tuple[Any, Any]:
    if not isinstance(variables, Mapping) or "params" not in variables or "base" not in variables:
        got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
        raise ValueError(
            "an adapted model's variables are {'params': the factors, 'base': the frozen weights}; "
            f"got {got}. Pass the adapted bundle's variables (or state.variables of its run)"
        )
    return jax.lax.stop_gradient(variables["base"]), variables["params"]


def merge(base: Mapping[str, Any], factors: Mapping[str, Any], scaling: float,
          experts: Sequence[tuple[str, Sequence[str]]] = (), *, dense: bool = True) -> dict[str, Any]:
    """``base`` params with each adapted kernel replaced by ``W + scaling * A B`` (in W's dtype):
    the projections' kernels (unless ``dense=False``) and the expert kernels of ``experts``, each
    taking its slice of its factor pair's update along the output axis."""
    keys = _tuple_keys(base)
    flat = {name: value for name, (_, value) in keys.items()}
    flat_factors = {name: value for name, (_, value) in _tuple_keys(factors).items()}

    def add(path: str, delta: jax.Array) -> None:
        flat[path] = (flat[path].astype(jnp.float32) + delta).astype(flat[path].dtype)

    stacked = {path for path, _ in experts}
    if dense:
        for path in [p for p in flat_factors if p.endswith("/lora_A")]:
            module = path[: -len("/lora_A")]
            if module not in stacked:
                add(f"{module}/kernel", jnp.matmul(flat_factors[path], flat_factors[f"{module}/lora_B"]) * scaling)
    for module, kernels in experts:
        delta = jnp.matmul(flat_factors[f"{module}/lora_A"], flat_factors[f"{module}/lora_B"]) * scaling
        start = 0
        for path in kernels:
            width = flat[path].shape[-1]
            add(path, delta[..., start:start + width])
            start += width
    return traverse_util.unflatten_dict({keys[name][0]: value for name, value in flat.items()})


def _tuple_keys(tree: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], Any]]:
    """A params tree's leaves by "/"-joined path, each with its key tuple, so a module whose own
    name holds a "/" (a UNet's ``down_blocks_0/attentions_0``) keeps its place when rebuilt."""
    return {"/".join(key): (key, value) for key, value in traverse_util.flatten_dict(dict(tree)).items()}
