"""Pretrained / PretrainedDecoder: Hugging Face decoder checkpoints in and out of Dew.

``PretrainedDecoder.load(directory)`` reads config.json, translates it into `CausalTransformer`
arguments through the family of its ``model_type``, and renames (and transposes) every tensor of
model.safetensors into Dew's params by the family's weight table. Every checkpoint tensor must
land on a param of the expected shape, and every param must be filled, so a checkpoint that does
not match its config fails with the tensor's name instead of loading half-right.

``save(directory)`` runs the same table backwards: config.json, model.safetensors (torch names,
``[out, in]`` linear weights, no lm_head.weight when the head is tied), generation_config.json and
the tokenizer files. Everything is written into a hidden sibling directory that is renamed into
place at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.core import meta

from dew.data.tokenizers import HFTokenizer
from dew.files import staged_directory
from dew.hub import local_directory
from dew.interop import adapted, codecs, families, fp8_blocks
from dew.interop.families.llama import Weight
from dew.interop.safetensors_io import SINGLE_FILE, open_checkpoint, save_file
from dew.nn.adapters import LoRADecoder
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.moe import BALANCE_COLLECTION

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MTP_COLLECTION = "mtp"  # multi-token prediction layers: read, held frozen and written back, never run
TOKENIZER_FILE = "tokenizer.json"


# generation_config.json controls Dew's generate does not implement, with the value that leaves each off
UNSUPPORTED_CONTROLS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "max_time": None,
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "bad_words_ids": None,
    "force_words_ids": None,
    "sequence_bias": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "stop_strings": None,
}


# --- reading a checkpoint directory ---------------------------------------------------------------


def _checkpoint_dir(directory: str | Path, revision: str | None = None) -> Path:
    """A checkpoint directory: a local one, or a Hub repository's snapshot from the Hugging Face cache."""
    return local_directory(directory, revision=revision, what="checkpoint")


def _source_name(directory: str | Path) -> str:
    """How a bundle names where it came from: a local directory by its absolute path (so a run
    record that references it reads from any working directory), a Hub repository by its id."""
    local = Path(directory).expanduser()
    return str(local.absolute()) if local.is_dir() else str(directory)


def read_config(directory: str | Path) -> dict[str, Any]:
    """The config.json of a checkpoint directory, with a clear error when it is missing."""
    path = _checkpoint_dir(directory) / CONFIG_FILE
    if not path.is_file():
        present = sorted(p.name for p in path.parent.iterdir())[:12]
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {path.parent}; a Hugging Face checkpoint directory holds config.json "
            f"beside its weights. The directory holds {present}"
        )
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


# --- params <-> checkpoint tensors ----------------------------------------------------------------


def _flat(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A params tree as {"a/b/kernel": array}, the names the weight tables use."""
    return traverse_util.flatten_dict(dict(tree), sep="/")


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    return traverse_util.unflatten_dict(dict(flat), sep="/")


def _flat_weights(variables: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint-backed variables flat: params by their path (``layers_0/mlp/gate``), the
    routers' balancing bias under its collection (``balance/layers_1/mlp/score_bias``), as the
    weight tables name them. Other collections (a DPO reference, router records) are not weights."""
    flat = _flat(variables["params"])
    for path, value in _flat(variables.get(BALANCE_COLLECTION, {})).items():
        flat[f"{BALANCE_COLLECTION}/{path}"] = value
    return flat


def _weight_variables(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`_flat_weights` (with any ``mtp/`` entries) back to a variables mapping."""
    variables = {"params": {}}
    for path, value in flat.items():
        collection, _, inner = path.partition("/")
        if collection not in (BALANCE_COLLECTION, MTP_COLLECTION):
            collection, inner = "params", path
        variables.setdefault(collection, {})[inner] = value
    return {collection: _nested(tree) for collection, tree in variables.items()}


def _expected_params(model: CausalTransformer) -> dict[str, jax.ShapeDtypeStruct]:
    """Every weight path of ``model`` (`_flat_weights`) with its shape and dtype, computed without allocating."""
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    return _flat_weights(meta.unbox(abstract))


def _layered(model: CausalTransformer) -> CausalTransformer:
    """The same model with one ``layers_{i}`` subtree per layer (the layout the tables name)."""
    return model.clone(scan_layers=False, remat=None) if model.scan_layers else model


def _split_collection(path: str) -> tuple[str, str]:
    """A flat weight path as (its collection prefix, the path inside the collection)."""
    prefix = f"{BALANCE_COLLECTION}/"
    return (prefix, path[len(prefix):]) if path.startswith(prefix) else ("", path)


def _stack_layers(flat: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``layers_{i}/...`` entries -> ``layers/...`` with the layer index as the leading axis."""
    out = {path: value for path, value in flat.items() if not _split_collection(path)[1].startswith("layers_")}
    for prefix, inner in map(_split_collection, flat):
        if inner.startswith("layers_0/"):
            rest = inner.split("/", 1)[1]
            out[f"{prefix}layers/{rest}"] = jnp.stack([flat[f"{prefix}layers_{i}/{rest}"] for i in range(num_layers)])
    return out


def _unstack_layers(flat: dict[str, Any], num_layers: int) -> dict[str, Any]:
    out = {path: value for path, value in flat.items() if not _split_collection(path)[1].startswith("layers/")}
    for path, value in flat.items():
        prefix, inner = _split_collection(path)
        if inner.startswith("layers/"):
            rest = inner.split("/", 1)[1]
            for i in range(num_layers):
                out[f"{prefix}layers_{i}/{rest}"] = value[i]
    return out


def _weight_names(family: ModuleType, model: CausalTransformer, expected: Mapping[str, Any], *,
                  layers: Any = None, complete: bool = True) -> list[Weight]:
    """The family's table expanded over the layers, keeping the tensors this model has (``layers``:
    only those layers' tensors; ``complete``: check every expected param is named)."""
    names = []
    for weight in family.WEIGHTS:
        if layers is not None and "{i}" not in weight.dew:
            continue
        indices = (range(model.num_layers) if layers is None else layers) if "{i}" in weight.dew else [None]
        for i in indices:
            dew = weight.dew.format(i=i) if i is not None else weight.dew
            if dew not in expected:
                continue
            experts = range(expected[dew].shape[0]) if "{e}" in weight.hf else [None]
            for e in experts:  # one checkpoint tensor per expert, one stacked param in Dew
                names.append(Weight(weight.hf.format(i=i, e=e), dew, weight.transpose, e))
    covered = {w.dew for w in names}
    uncovered = sorted(set(expected) - covered)
    if uncovered and complete:  # a table that misses a param is a bug in the family, not in the checkpoint
        raise NotImplementedError(
            f"the {family.MODEL_TYPE} weight table has no checkpoint name for params {uncovered[:5]}"
        )
    return names


def _mtp_names(family: ModuleType, model: CausalTransformer, expected: Mapping[str, Any],
               k: int) -> tuple[list[Weight], dict[str, tuple[int, ...]]]:
    """Multi-token prediction layer ``k``'s tensors (`families.deepseek_v3.MTP_WEIGHTS`, and a
    decoder layer named as the model's last is) with their flat paths ``mtp/layers_{k}/...`` and shapes."""
    last, index = model.num_layers - 1, model.num_layers + k
    where = f"{MTP_COLLECTION}/layers_{k}"
    hidden, vocab = expected["embed_tokens/embedding"].shape[::-1]
    names, shapes = [], {}
    for weight in family.MTP_WEIGHTS:
        dew = weight.dew
        names.append(Weight(weight.hf.format(i=index), f"{where}/{dew}", weight.transpose))
        shapes[f"{where}/{dew}"] = family.mtp_shapes(hidden, vocab)[dew]
    block_names = _weight_names(family, model, expected, layers=[last], complete=False)
    for weight in block_names:
        inner = _split_collection(weight.dew)[1].split("/", 1)[1]  # the path inside the last layer
        path = f"{where}/block/{inner}"
        names.append(Weight(weight.hf.replace(f"model.layers.{last}.", f"model.layers.{index}.", 1), path,
                            weight.transpose, weight.expert))
        shapes[path] = tuple(expected[weight.dew].shape)
    return names, shapes


def _mtp_present(family: ModuleType, model: CausalTransformer, config: Mapping[str, Any], checkpoint: Any) -> int:
    """How many multi-token prediction layers the checkpoint holds (config.json may name more)."""
    if not hasattr(family, "MTP_WEIGHTS"):
        return 0
    layers = 0
    while layers < family.mtp_layers(config) and family.MTP_MARKER.format(i=model.num_layers + layers) in checkpoint:
        layers += 1
    return layers


def _hf_shape(weight: Weight, shape: tuple[int, ...]) -> tuple[int, ...]:
    if weight.expert is not None:  # one expert's slice of the stacked param
        shape = shape[1:]
    return tuple(reversed(shape)) if weight.transpose else tuple(shape)


def _some(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def _describe(config: Mapping[str, Any]) -> str:
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
            "attention_bias", "mlp_bias", "num_experts", "num_local_experts", "moe_intermediate_size")
    return ", ".join(f"{k}={config[k]}" for k in keys if k in config)


def _read_params(directory: Path, family: ModuleType, model: CausalTransformer,
                 config: Mapping[str, Any], param_dtype: Any,
                 fp8_scales: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The variables (params, and the balancing bias) from the checkpoint's tensors; FP8 block weights are dequantized and their scales
    kept in ``fp8_scales`` (by weight name) for `PretrainedDecoder.save`."""
    checkpoint = codecs.DecodedCheckpoint(open_checkpoint(directory), str(directory))  # MXFP4 pairs decoded
    quantization = fp8_blocks.BlockQuantization.from_config(config)
    layered = _layered(model)
    expected = _expected_params(layered)
    names = _weight_names(family, layered, expected)
    for k in range(_mtp_present(family, layered, config, checkpoint)):
        mtp_names, mtp_shapes = _mtp_names(family, layered, expected, k)
        names += mtp_names
        expected = {**expected, **{path: jax.ShapeDtypeStruct(shape, jnp.float32) for path, shape in mtp_shapes.items()}}
    wanted = {w.hf for w in names}

    def ignorable(name: str) -> bool:
        if name.endswith(family.IGNORED_SUFFIXES):
            return True
        if hasattr(family, "ignored") and family.ignored(name, config):  # e.g. layers beyond the model
            return True
        if name.endswith(fp8_blocks.SCALE_SUFFIX):  # read with the weight it scales
            return name[: -len(fp8_blocks.SCALE_SUFFIX)] in wanted

        # a tied head: transformers ignores a stored lm_head.weight and uses the embedding
        return name == "lm_head.weight" and model.tie_embeddings

    missing = [w.hf for w in names if w.hf not in checkpoint]
    unexpected = [name for name in checkpoint if name not in wanted and not ignorable(name)]
    if missing or unexpected:
        parts = [f"{label} tensors {_some(found)}"
                 for label, found in (("missing", missing), ("unexpected", unexpected)) if found]
        raise ValueError(
            f"the weights in {directory} do not match its config.json: {'; '.join(parts)}. "
            f"The config describes {_describe(config)}; check the weights belong to this config"
        )

    dtype = jnp.dtype(param_dtype)
    flat, experts = {}, {}
    for weight in names:
        want = _hf_shape(weight, expected[weight.dew].shape)
        got = checkpoint.shape(weight.hf)
        if got != want:
            raise ValueError(
                f"checkpoint tensor {weight.hf!r} in {directory} has shape {list(got)}, but config.json "
                f"({_describe(config)}) implies {list(want)}; the weights and the config disagree"
            )
        array = checkpoint[weight.hf]
        if array.dtype == fp8_blocks.FP8:
            array = _dequantized(checkpoint, weight.hf, array, quantization, directory, fp8_scales)
        if weight.transpose:
            array = array.T
        if weight.expert is not None:
            experts.setdefault(weight.dew, []).append(np.asarray(array, dtype=dtype))
            continue
        kept = np.float32 if weight.dew.endswith("/score_bias") else dtype  # the balancing bias stays float32
        flat[weight.dew] = jnp.asarray(np.asarray(array, dtype=kept))
    for path, slices in experts.items():  # the table lists a param's experts in order
        flat[path] = jnp.asarray(np.stack(slices))
    if model.scan_layers:
        flat = _stack_layers(flat, model.num_layers)
    return _weight_variables(flat)


def _dequantized(checkpoint: Any, name: str, values: np.ndarray, quantization: Any, directory: Path,
                 fp8_scales: dict[str, np.ndarray] | None) -> np.ndarray:
    """A float8 checkpoint tensor in float32, by its block scales (`dew.interop.fp8_blocks`)."""
    if quantization is None:
        raise ValueError(
            f"checkpoint tensor {name!r} in {directory} is float8_e4m3fn, but config.json has no "
            "quantization_config saying how it is scaled; add the checkpoint's quantization_config"
        )
    scale_name = name + fp8_blocks.SCALE_SUFFIX
    if scale_name not in checkpoint:
        raise ValueError(
            f"checkpoint tensor {name!r} in {directory} is FP8 but {scale_name!r}, its block scales, is "
            "missing; the checkpoint is incomplete"
        )
    scale = np.asarray(checkpoint[scale_name], np.float32)
    if fp8_scales is not None:
        fp8_scales[name] = scale
    return fp8_blocks.dequantize(values, scale, quantization.block, name)


def _check_params(model: CausalTransformer, variables: Mapping[str, Any]) -> dict[str, Any]:
    """Flat weights (`_flat_weights`) after checking them against the model's own tree (names and shapes)."""
    expected = _expected_params(model)
    flat = _flat_weights(variables)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the variables do not fit the model: missing params {missing[:8]}, unexpected params "
            f"{unexpected[:8]}. Pass the variables trained with this model (state.variables: its 'params' "
            f"and, for routers with a balancing bias, '{BALANCE_COLLECTION}')"
        )
    for path, spec in expected.items():
        if tuple(np.shape(flat[path])) != tuple(spec.shape):
            raise ValueError(
                f"param {path!r} has shape {list(np.shape(flat[path]))}, but the model expects "
                f"{list(spec.shape)}; the variables were made for another configuration"
            )
    return flat


# --- tokens and generation defaults ---------------------------------------------------------------


def _check_tokenizer(tokenizer: Any, vocab_size: int, where: str) -> None:
    size = getattr(tokenizer, "vocab_size", None)
    if size is not None and size > vocab_size:
        raise ValueError(
            f"the tokenizer {where} has {size} tokens but the model's vocab_size is {vocab_size}, so "
            "some token ids would have no embedding; use the model's own tokenizer or build the "
            f"model with vocab_size >= {size}"
        )


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {}
    for field, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"), ("pad_id", "pad_token_id")):
        value = getattr(tokenizer, field, None) if tokenizer is not None else None
        if value is not None:
            ids[key] = int(value)
    return ids


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


# --- the bundles ----------------------------------------------------------------------------------


class Pretrained:
    """A model and its weights in a Hugging Face checkpoint's terms.

    ``Pretrained.load(directory)`` reads any checkpoint Dew supports, dispatching on config.json's
    ``model_type`` (today: decoders, see `PretrainedDecoder`), or on a diffusers pipeline's
    model_index.json (`dew.interop.diffusion_pipelines.DiffusionPipeline`); ``bundle.save(directory)``
    writes a decoder back in the same layout.
    """

    @classmethod
    def load(cls, directory: str | Path, *, revision: str | None = None, **options: Any) -> "Pretrained":
        """The bundle for the checkpoint in ``directory`` (or a Hub repository id, read from the
        Hugging Face cache at ``revision``); ``options`` go to the family's loader."""
        path = _checkpoint_dir(directory, revision)
        if (path / "model_index.json").is_file():  # a diffusers pipeline directory
            from dew.interop.diffusion_pipelines import DiffusionPipeline

            return DiffusionPipeline.load(path, **options)
        config = read_config(path)
        families.decoder_family(config, str(path / CONFIG_FILE))  # raises when unsupported
        return dataclasses.replace(PretrainedDecoder.load(path, **options), source=_source_name(directory))

    def save(self, directory: str | Path, variables: Mapping[str, Any] | None = None, *,
             overwrite: bool = False) -> Path:
        raise NotImplementedError(f"{type(self).__name__} does not implement save")


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedDecoder(Pretrained):
    """A `CausalTransformer`, its variables, and the files of the checkpoint it came from.

    Attributes:
      model: the CausalTransformer.
      variables: ``{"params": ...}`` (plain arrays), with the routers' balancing bias in
        ``"balance"`` for a model that has one (DeepSeek-V3's ``e_score_correction_bias``) and its
        multi-token prediction layers in ``"mtp"`` when the checkpoint holds them (frozen, saved back).
      tokenizer: an HFTokenizer when the directory holds tokenizer.json, else None.
      config: the Hugging Face config.json as a dict.
      generation_config: generation_config.json as a dict, or None.
      source: the directory or Hub repository id it was loaded from (None when built in Dew);
        an adapter saved from it names this as its base.
      packed_scales: the checkpoint's MXFP4 tensors (GPT-OSS's experts), by name, with the block
        scales they were read with; `save` packs them again (`dew.interop.codecs`).
      fp8_scales: the block scales of a checkpoint's FP8 weights, by tensor name (None: none);
        `save` writes those weights back as FP8 blocks (`dew.interop.fp8_blocks`).
    """

    model: CausalTransformer
    variables: Mapping[str, Any]
    tokenizer: Any = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    generation_config: Mapping[str, Any] | None = None
    source: str | None = None
    packed_scales: Mapping[str, np.ndarray] | None = None
    fp8_scales: Mapping[str, np.ndarray] | None = None

    # --- in -------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        max_seq_len: int | None = None,
        scan_layers: bool = False,
        remat: str | None = None,
        attention_impl: str = "auto",
        revision: str | None = None,
    ) -> "PretrainedDecoder":
        """Read a decoder checkpoint directory (config.json + model.safetensors or a sharded index),
        or a Hub repository id from the Hugging Face cache (``revision``: a branch, tag or commit).

        ``dtype`` is the compute dtype, ``param_dtype`` the dtype the weights are stored in (the
        checkpoint's tensors are cast to it; "auto" keeps config.json's dtype). ``max_seq_len``
        overrides the checkpoint's max_position_embeddings (RoPE scaling still reads the
        checkpoint's context).
        """
        path = _checkpoint_dir(directory, revision)
        config = read_config(path)
        if isinstance(param_dtype, str) and param_dtype == "auto":
            param_dtype = jnp.dtype(config.get("torch_dtype") or config.get("dtype") or "float32")
        family = families.decoder_family(config, str(path / CONFIG_FILE))
        if config.get("auto_map"):
            warnings.warn(
                f"{path / CONFIG_FILE} names remote code in auto_map; Dew ignores it and loads the "
                f"weights into its own {family.MODEL_TYPE} implementation",
                stacklevel=2,
            )
        kwargs = family.model_kwargs(config)
        if max_seq_len is not None:
            kwargs["max_seq_len"] = int(max_seq_len)
        model = CausalTransformer(**kwargs, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers,
                                  remat=remat, attention_impl=attention_impl)
        fp8_scales: dict[str, np.ndarray] = {}
        variables = _read_params(path, family, model, config, param_dtype, fp8_scales)
        packed = codecs.DecodedCheckpoint(open_checkpoint(path), str(path))
        packed_scales = {name: packed.scales(name) for name in packed.packed} or None

        tokenizer = None
        if (path / TOKENIZER_FILE).is_file():
            tokenizer = HFTokenizer(path)
            _check_tokenizer(tokenizer, model.vocab_size, f"in {path}")
        return cls(model=model, variables=variables, tokenizer=tokenizer, config=config,
                   generation_config=_read_json(path / GENERATION_CONFIG_FILE), source=_source_name(directory),
                   packed_scales=packed_scales, fp8_scales=fp8_scales or None)

    @classmethod
    def from_model(
        cls,
        model: CausalTransformer,
        variables: Mapping[str, Any],
        tokenizer: Any = None,
        generation_config: Mapping[str, Any] | None = None,
    ) -> "PretrainedDecoder":
        """Wrap a model trained in Dew for export; fails now if no supported family can express it.

        A model with q/k norm exports as qwen3, one without as llama.
        """
        if not isinstance(model, CausalTransformer):
            raise TypeError(f"from_model exports a CausalTransformer; got {type(model).__name__}")
        if not isinstance(variables, Mapping) or "params" not in variables:
            got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
            raise ValueError(f"variables must be the Flax mapping with a 'params' collection; got {got}")
        if tokenizer is not None:
            _check_tokenizer(tokenizer, model.vocab_size, repr(tokenizer))
        config = families.export_family(model).hf_config(model)
        return cls(model=model, variables=variables, tokenizer=tokenizer, config=config,
                   generation_config=None if generation_config is None else dict(generation_config))

    @classmethod
    def from_run(cls, run: str | Path, *, step: int | None = None, ema: bool = True) -> "PretrainedDecoder":
        """Wrap a saved Dew run (run.json beside its checkpoints) for export.

        The model is rebuilt from the record, the weights are those of `step` (the latest by
        default; the EMA copy when `ema`, which raises when the run keeps none), and the run's
        tokenizer and sampling defaults come along. A run that trained a LoRA adapter gives its
        `AdaptedDecoder`: the base loaded again from where run.json names it, with the run's factors.
        """
        from dew.config.saved import load_run  # a run record sits in the layer below interop

        saved = load_run(run, step=step)
        model = saved.config.model.build()
        if isinstance(model, LoRADecoder):
            return cls._adapted_from_run(run, saved, model, ema)
        if not isinstance(model, CausalTransformer):
            raise ValueError(f"{run} is not a decoder run (its model is {type(model).__name__}); export reads decoders.")
        state = saved.state()
        if ema and state.ema is None:
            raise ValueError(f"ema=True asks for {run}'s moving-average weights, but the run keeps no EMA copy; pass ema=False (dew export --live).")
        variables = state.averaged if ema else state.variables
        # the weights alone: never a DPO reference
        variables = {name: value for name, value in variables.items()
                     if name in ("params", BALANCE_COLLECTION, MTP_COLLECTION)}
        sampling = saved.config.sampling
        generation_config = None
        if sampling is not None:
            generation_config = {"do_sample": sampling.temperature > 0}
            if sampling.temperature > 0:
                generation_config["temperature"] = sampling.temperature
            for name in ("top_k", "top_p", "min_p"):
                if getattr(sampling, name) is not None:
                    generation_config[name] = getattr(sampling, name)
        return cls.from_model(model, variables, tokenizer=saved.tokenizer(), generation_config=generation_config)

    @classmethod
    def _adapted_from_run(cls, run: str | Path, saved: Any, model: LoRADecoder, ema: bool) -> Any:
        """An adapted run: its base loaded from where run.json names it, with the run's factors."""
        if model.base is None:
            raise ValueError(
                f"{run} trains a LoRA adapter, but its run.json names no base checkpoint to load the "
                "frozen weights from; record the model of a bundle from Pretrained.load(...).adapt(...)"
            )
        state = saved.state()
        if ema and state.ema is None:
            raise ValueError(f"ema=True asks for {run}'s moving-average factors, but the run keeps no EMA copy; pass ema=False (dew export --live).")
        factors = (state.averaged if ema else state.variables)["params"]
        decoder = model.model
        base = cls.load(model.base, dtype=decoder.dtype, param_dtype=decoder.param_dtype,
                        max_seq_len=decoder.max_seq_len, scan_layers=decoder.scan_layers)
        return adapted.restore(base, model, factors)

    # --- use ------------------------------------------------------------------------------------

    def adapt(self, lora: Any, *, key: Any = None) -> Any:
        """This decoder with a LoRA adapter (`dew.nn.adapters.LoRA`): an `AdaptedDecoder` whose
        objective trains the adapter's factors alone. ``key`` (an int seed or a key) draws fresh
        factors; a ``LoRA.load(directory)`` brings a PEFT adapter's trained factors (no key)."""
        return adapted.adapt(self, lora, key=key)

    def default_sampling(self) -> Any:
        """The checkpoint's generation defaults as a Sampling: greedy unless it says do_sample."""
        from dew.sampling.text import Sampling  # interop sits below sampling; import on use

        generation = dict(self.generation_config or {})
        eos = _as_ids(generation.get("eos_token_id", self.config.get("eos_token_id")))
        if not eos and self.tokenizer is not None and self.tokenizer.eos_id is not None:
            eos = (int(self.tokenizer.eos_id),)
        pad = generation.get("pad_token_id", self.config.get("pad_token_id"))
        if pad is None:
            pad = getattr(self.tokenizer, "pad_id", None)
        options: dict[str, Any] = dict(eos_token_ids=eos, pad_id=int(pad if pad is not None else (eos or (0,))[0]))
        if generation.get("do_sample", False):
            options.update(
                temperature=float(generation.get("temperature", 1.0)),
                top_k=generation.get("top_k", 50) or None,  # transformers' default top_k is 50
                top_p=generation.get("top_p"),
                min_p=generation.get("min_p"),
            )
        else:
            options["temperature"] = 0.0
        return Sampling(**options)

    def text_generation(self, sampling: Any = None) -> Any:
        """A TextGeneration task over these weights, with the tokenizer and the checkpoint's defaults:
        its sampling, budget (max_new_tokens, or max_length) and continuations per prompt.

        Raises when generation_config.json turns on a control Dew does not implement (a repetition
        penalty, wall-clock stopping, beam search, ...), rather than generating without it.
        """
        from dew.inference.text import TextGeneration  # the tasks layer sits below interop

        generation = dict(self.generation_config or {})
        active = {name: generation[name] for name, off in UNSUPPORTED_CONTROLS.items()
                  if generation.get(name) is not None and generation[name] not in (off if isinstance(off, tuple) else (off,))}
        if active:
            raise ValueError(
                f"generation_config.json sets {active}, which Dew's generate does not implement, so its "
                "defaults cannot be followed. Build the task yourself: TextGeneration(bundle.model, "
                "bundle.variables, sampling=..., processor=bundle.tokenizer)."
            )
        return TextGeneration(self.model, self.variables,
                              sampling=self.default_sampling() if sampling is None else sampling,
                              processor=self.tokenizer,
                              max_new_tokens=generation.get("max_new_tokens"),
                              max_length=None if generation.get("max_new_tokens") else generation.get("max_length"),
                              n=generation.get("num_return_sequences") or 1)

    # --- out ------------------------------------------------------------------------------------

    def export_config(self) -> dict[str, Any]:
        """The config.json `save` writes: the family's fields over the source config's others."""
        source = dict(self.config or {})
        family = families.export_family(self.model, preferred=source.get("model_type"))
        derived = family.hf_config(self.model)
        if source.get("model_type") != family.MODEL_TYPE:
            source = {}  # a config of another family describes nothing of this one
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "layer_types", "sliding_window",
                    "use_sliding_window", "max_window_layers", "auto_map"):
            source.pop(key, None)
        if source.get("max_position_embeddings"):
            # the checkpoint's context, even when it was loaded with another max_seq_len
            derived["max_position_embeddings"] = source["max_position_embeddings"]
        config = {**source, **derived}
        for key, value in _token_ids(self.tokenizer).items():
            config.setdefault(key, value)
        return config

    def save(
        self,
        directory: str | Path,
        variables: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
        dtype: Any = None,
    ) -> Path:
        """Write config.json, model.safetensors, generation_config.json and the tokenizer files.

        ``variables`` (default: the bundle's) are the weights to write, such as a trained
        ``state.variables``. ``dtype`` casts floating tensors (default: as they are); the tensors
        the checkpoint held in MXFP4 are packed again (``packed_scales``). A non-empty
        ``directory`` is replaced only with ``overwrite=True``. The files are written into a
        temporary sibling directory renamed into place at the end, so a failure leaves nothing.
        """
        dest = Path(directory).expanduser()
        if dest.exists() and not dest.is_dir():
            raise FileExistsError(f"{dest} exists and is not a directory; choose another destination")
        if dest.is_dir() and any(dest.iterdir()) and not overwrite:
            raise FileExistsError(
                f"{dest} is not empty; pass overwrite=True to replace it or choose an empty directory"
            )
        variables = self.variables if variables is None else variables
        if not isinstance(variables, Mapping) or "params" not in variables:
            got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
            raise ValueError(f"variables must be the Flax mapping with a 'params' collection; got {got}")
        config = self.export_config()  # raises before anything is written
        tensors = self._hf_tensors(meta.unbox(dict(variables)), dtype, config)
        if "num_nextn_predict_layers" in config:  # the multi-token prediction layers written, if any
            config["num_nextn_predict_layers"] = len(variables.get(MTP_COLLECTION, {}))
        if self.packed_scales:
            tensors = codecs.pack_mxfp4_tensors(tensors, sorted(self.packed_scales), self.packed_scales)
        float_dtypes = {str(t.dtype) for t in tensors.values() if np.issubdtype(t.dtype, np.floating)
                        or t.dtype == jnp.bfloat16}
        if len(float_dtypes) == 1:
            config["torch_dtype"] = float_dtypes.pop()
            config.pop("dtype", None)
        generation = dict(self.generation_config or {})
        generation.update({k: v for k, v in _token_ids(self.tokenizer).items() if k not in generation})

        with staged_directory(dest) as staging:
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_file(tensors, staging / SINGLE_FILE, metadata={"format": "pt"})
            (staging / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
            if self.tokenizer is not None:
                self.tokenizer.save(staging)
        return dest

    def _mtp_tensors(self, variables: Mapping[str, Any], family: ModuleType, layered: CausalTransformer,
                     dtype: Any) -> dict[str, np.ndarray]:
        """The multi-token prediction layers of ``variables["mtp"]``, by checkpoint name (none without)."""
        held = _flat(variables.get(MTP_COLLECTION, {}))
        if not held:
            return {}
        if not hasattr(family, "MTP_WEIGHTS"):
            raise ValueError(f"the variables hold multi-token prediction layers, which {family.MODEL_TYPE} "
                             "checkpoints do not have; drop variables['mtp'] to export the causal LM alone")
        layers = len({path.split("/", 1)[0] for path in held})
        expected = _expected_params(layered)
        tensors, read = {}, set()
        for k in range(layers):
            for weight in _mtp_names(family, layered, expected, k)[0]:
                path = weight.dew.split("/", 1)[1]
                if path not in held:
                    raise ValueError(f"variables['mtp'] has no {path!r}; pass the mtp collection the bundle was loaded with")
                read.add(path)
                array = np.asarray(jax.device_get(held[path]))
                if weight.expert is not None:
                    array = array[weight.expert]
                if weight.transpose:
                    array = array.T
                if dtype is not None and (np.issubdtype(array.dtype, np.floating) or array.dtype == jnp.bfloat16):
                    array = array.astype(jnp.dtype(dtype))
                tensors[weight.hf] = np.ascontiguousarray(array)
        if set(held) - read:
            raise ValueError(f"variables['mtp'] holds {sorted(set(held) - read)[:4]}, which no checkpoint tensor names")
        return tensors

    def _hf_tensors(self, variables: Mapping[str, Any], dtype: Any,
                    config: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Checkpoint name -> host array, by the export family's table."""
        model = self.model
        flat = _check_params(model, variables)
        if model.scan_layers:
            flat = _unstack_layers(flat, model.num_layers)
        layered = _layered(model)
        family = families.DECODER_FAMILIES[config["model_type"]]
        tensors = {}
        for weight in _weight_names(family, layered, _expected_params(layered)):
            array = np.asarray(jax.device_get(flat[weight.dew]))
            if weight.expert is not None:
                array = array[weight.expert]
            if weight.transpose:
                array = array.T
            if dtype is not None and (np.issubdtype(array.dtype, np.floating) or array.dtype == jnp.bfloat16):
                array = array.astype(jnp.dtype(dtype))
            tensors[weight.hf] = np.ascontiguousarray(array)
        tensors.update(self._mtp_tensors(variables, family, layered, dtype))
        quantization = fp8_blocks.BlockQuantization.from_config(config)
        if self.fp8_scales and quantization is not None:  # back to FP8 blocks, as the checkpoint was read
            for name, scale in self.fp8_scales.items():
                if name not in tensors:
                    raise ValueError(f"the FP8 weight {name!r} this checkpoint was read with is not among the "
                                     f"tensors {config['model_type']} writes; save the model it was loaded as")
                tensors[name], tensors[name + fp8_blocks.SCALE_SUFFIX] = fp8_blocks.quantize(
                    tensors[name], quantization.block, scale)
        return tensors
