"""DewLM: a Dew decoder behind lm-eval-harness's `LM` interface.

``lm_eval.simple_evaluate(model=DewLM("runs/lm"), tasks=[...])`` scores a saved run, a checkpoint
directory, a Hub repository id (each read through `dew.pipeline`) or a `TextGeneration` task.
Requests are tokenized as lm-eval's own Hugging Face model (HFLM) tokenizes them, so the two give
the same numbers on the same weights: a context's trailing spaces move to the continuation, an
empty context is conditioned on the prefix token (BOS, else EOS), inputs longer than the context
window keep their last `max_length` tokens, and long documents are scored in HFLM's rolling windows.

Scoring rows are padded on the right to a power-of-two width and the batch to `batch_size` rows,
so each width compiles once. lm-eval is optional: without it DewLM is a plain class that takes any
objects with an ``.args`` tuple (the `eval-harness` extra installs lm-eval).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from dew.checks import count
from dew.data.chat_messages import ChatTemplate, TemplateError
from dew.widths import padded_width

try:  # lm-eval's base class when it is installed, so lm_eval.simple_evaluate accepts a DewLM
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model as _register
except ImportError:  # the adapter works without it, over any request objects with .args
    _Base = object

    def _register(*names):
        return lambda cls: cls

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's max_gen_toks when a request names none


def _pipeline(source: Any, options: dict[str, Any]) -> Any:
    """The TextGeneration task `source` names (a task passes through)."""
    from dew.inference.pipeline import pipeline
    from dew.inference.text import TextGeneration

    if isinstance(source, TextGeneration):
        if options:
            raise ValueError(f"{sorted(options)} configure dew.pipeline; a TextGeneration task is used as given.")
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"DewLM reads a run directory, a checkpoint directory, a Hub repository id or a TextGeneration "
            f"task; got {type(source).__name__}."
        )
    task = pipeline(source, **options)
    if not isinstance(task, TextGeneration):
        raise TypeError(f"{source} serves a {type(task).__name__}; DewLM scores decoders (a TextGeneration task).")
    return task


@_register("dew")  # simple_evaluate(model="dew", model_args={"source": ...}) once this module is imported
class DewLM(_Base):
    """lm-eval's `LM` over a Dew decoder: `loglikelihood`, `loglikelihood_rolling`, `generate_until`.

    Args:
      source: a saved run, a checkpoint directory or a Hub id (through `dew.pipeline`, which takes
        `pipeline_options` such as step=, ema=, dtype=, mesh=), or a TextGeneration task.
      batch_size: rows per forward pass (the batch is padded to it, so it compiles once per width);
        on a task placed over several devices it is rounded up to a multiple of their row shards,
        and each device scores its share.
      max_length: the context window in tokens (default: the model's max_seq_len, as HFLM reads
        max_position_embeddings).
      max_gen_toks: the generation budget when a request names none.
      tokenizer: a tokenizer to use instead of the task's.
      prefix_token_id: the token an empty context is conditioned on (default: BOS, else EOS).
      seed: the key for requests that ask to sample (greedy requests use none).
      enable_thinking, chat_template_args: the chat template's controls when lm-eval applies it
        (`simple_evaluate(..., apply_chat_template=True)`), as HFLM takes them: enable_thinking
        joins chat_template_args, and each must be a name the template reads.
      think_end_token: the text or token id that ends a reasoning section; generations keep what
        follows its last occurrence (needed with enable_thinking=True, as in HFLM).
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        tokenizer: Any = None,
        prefix_token_id: int | None = None,
        seed: int = 0,
        enable_thinking: bool | None = None,
        chat_template_args: dict[str, Any] | None = None,
        think_end_token: str | int | None = None,
        **pipeline_options: Any,
    ):
        super().__init__()
        self.task = _pipeline(source, pipeline_options)
        self.batch_size = count(batch_size, "batch_size")
        self.max_gen_toks = count(max_gen_toks, "max_gen_toks")
        self.seed = count(seed, "seed", minimum=0)
        model = self.task.model
        self.max_length = count(max_length, "max_length", optional=True) or model.max_seq_len
        if self.max_length > model.max_seq_len:
            raise ValueError(
                f"max_length={self.max_length} is longer than the model's max_seq_len={model.max_seq_len}; "
                "pass a smaller max_length, or load the checkpoint with a longer context."
            )
        self.tokenizer = tokenizer if tokenizer is not None else self.task.tokenizer
        if self.tokenizer is None:
            raise ValueError(
                "DewLM reads text, and this task has no tokenizer; pass tokenizer= (for example "
                "dew.data.load_tokenizer(directory))."
            )
        eos = getattr(self.tokenizer, "eos_id", None)
        bos = getattr(self.tokenizer, "bos_id", None)
        self.eot_token_id = eos
        if prefix_token_id is None:
            prefix_token_id = bos if bos is not None else eos
        if prefix_token_id is None:
            raise ValueError("The tokenizer names neither a BOS nor an EOS token; pass prefix_token_id=.")
        self.prefix_token_id = int(prefix_token_id)
        self.chat_template_args = dict(chat_template_args or {})
        if enable_thinking is not None:
            self.chat_template_args["enable_thinking"] = enable_thinking
        if enable_thinking and think_end_token is None:
            raise ValueError(
                "enable_thinking=True needs think_end_token= (the text or id that ends the reasoning, e.g. "
                "'</think>'), so generations are scored on the answer after it."
            )
        if isinstance(think_end_token, str) and think_end_token.isdigit():  # lm-eval's model_args are strings
            think_end_token = int(think_end_token)
        self.think_end_token = think_end_token
        self._template = None
        if getattr(self.tokenizer, "chat_template", None):
            self._template = ChatTemplate(self.tokenizer.chat_template, self.tokenizer)
            self._template.check_controls(self.chat_template_args)
        elif self.chat_template_args:
            raise ValueError(
                f"chat_template_args {sorted(self.chat_template_args)} set controls of a chat template, and this "
                "tokenizer has none; drop them, or pass a tokenizer whose tokenizer_config.json carries one."
            )
        directory = getattr(self.tokenizer, "directory", None)  # an HFTokenizer's: the name HFLM keys by
        self._tokenizer_name = str(directory if directory is not None else source if isinstance(
            source, (str, os.PathLike)) else type(self.tokenizer).__name__)
        self._special_tokens = "add_special_tokens" in inspect.signature(self.tokenizer.encode).parameters
        self._score = _score_function(model)
        self._row_sharding = self.task.row_sharding if jax_process_count() == 1 else None
        if self._row_sharding is not None:  # data parallel: each device scores its share of the rows
            shards = row_shards(self._row_sharding)
            self.batch_size = -(-self.batch_size // shards) * shards

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> DewLM:
        """A DewLM from lm-eval's model arguments (`model="dew"`, `model_args={"source": ...}`).

        lm-eval's batch_size (a string from its command line) must name a fixed size; its device
        setting has no meaning here, since JAX places the weights (pass mesh= instead).
        """
        options = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None}}
        options.pop("max_batch_size", None)  # only read by lm-eval's automatic batch sizes
        if options.pop("device", None) is not None:
            raise ValueError("DewLM places its weights with JAX; drop device= (pass mesh=MeshSpec(...) to spread them).")
        size = options.get("batch_size")
        if isinstance(size, str):
            if not size.isdigit():
                raise ValueError(f"DewLM takes a fixed batch_size (it compiles once per width); got {size!r}.")
            options["batch_size"] = int(size)
        if "source" not in options:
            raise ValueError(f"DewLM's model_args need source= (a run, a checkpoint directory or a Hub id); got {sorted(options)}.")
        return cls(options.pop("source"), **options)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> DewLM:
        """A DewLM from lm-eval's "source=runs/lm,batch_size=16" argument string."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # --- chat templates, as HFLM applies them -------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's directory (else the source), which lm-eval keys its request cache by."""
        return self._tokenizer_name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template lm-eval records when it applies one: the tokenizer's own (None when off)."""
        if not chat_template:
            return None
        if self._template is None:
            raise ValueError("apply_chat_template was asked for, and this tokenizer carries no chat template.")
        return self._template.source

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The few-shot conversation as one prompt string, through the checkpoint's template with
        `chat_template_args`; without a generation prompt the last message is left open, so the
        model continues it. A template that refuses system messages gets the history without them."""
        if self._template is None:
            raise ValueError("apply_chat_template was asked for, and this tokenizer carries no chat template.")
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt,
                       controls=self.chat_template_args)
        try:
            return self._template.render(chat_history, **options)
        except TemplateError:
            return self._template.render([m for m in chat_history if m.get("role") != "system"], **options)

    # --- tokenization, as HFLM does it ----------------------------------------------------------

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `text`. By default the tokenizer's special tokens are added (a BOS, for
        tokenizers that add one) unless the text already starts with the prefix token's text."""
        if not self._special_tokens:
            return list(self.tokenizer.encode(text))
        if add_special_tokens is None:
            add_special_tokens = not text.startswith(self.token_text(self.prefix_token_id))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_text(self, token: int) -> str:
        """The text of one token, special tokens included (an HFTokenizer's decode drops its pad id,
        which is often the EOS)."""
        text = self.tok_decode([token], skip_special_tokens=False)
        if text == "" and callable(getattr(self.tokenizer, "id_to_token", None)):
            text = self.tokenizer.id_to_token(token) or ""
        return text

    def tok_decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._special_tokens:  # HF tokenizers can leave special tokens out
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(ids))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) for one loglikelihood request.

        Trailing whitespace of the context moves to the continuation, and the continuation's ids are
        what encoding the whole text adds after the context's, so word boundaries tokenize as in
        running text. An empty context becomes the prefix token (or, when the continuation itself
        starts with that token, the continuation's first token).
        """
        if context == "":
            ids = self.tok_encode(continuation, add_special_tokens=False)
            if ids and ids[0] == self.prefix_token_id:
                return ids[:1], ids[1:]
            return [self.prefix_token_id], ids
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids):]

    # --- lm-eval's requests ---------------------------------------------------------------------

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding produces it) per request."""
        pairs = [self.encode_pair(*_args(request, 2, "loglikelihood")) for request in requests]
        return self.score_tokens(pairs)

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-probability, scored in windows of at most `max_length` tokens."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = _args(request, 1, "loglikelihood_rolling")
            for window in rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score_tokens(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, cut at the first of its `until` strings.

        Requests with the same budget and sampling settings run together, `batch_size` at a time
        (a short batch is filled with copies of its first prompt, so it compiles as a full one),
        through the task with its KV cache: greedy unless they ask to sample.
        """
        import jax

        from dew.sampling.text import Sampling

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        settings = []
        for index, request in enumerate(requests):  # every request checked before any generates
            settings.append(self._generation_settings(_args(request, 2, "generate_until")[1]))
            _, budget, sampling_options = settings[-1]  # the until strings only cut the text
            groups.setdefault(repr((budget, sampling_options)), []).append(index)
        eos_text = None if self.eot_token_id is None else self.token_text(self.eot_token_id)
        for group_number, indices in enumerate(groups.values()):
            _, budget, sampling_options = settings[indices[0]]
            eos = () if self.eot_token_id is None else (self.eot_token_id,)
            sampling = Sampling(eos_token_ids=eos, pad_id=self.task.sampling.pad_id, **sampling_options)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                prompts = [self.tok_encode(_args(requests[i], 2, "generate_until")[0])[-(self.max_length - budget):]
                           for i in chunk]
                prompts += prompts[:1] * (self.batch_size - len(prompts))  # filler rows: one shape per width
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), group_number), start)
                drawn = self.task(prompts, budget, key=key, sampling=sampling).host()
                for i, row, length in zip(chunk, drawn.tokens, drawn.lengths):
                    until = settings[i][0]
                    stops = list(until) + ([eos_text] if eos_text is not None and eos_text not in until else [])
                    results[i] = cut_at(self._answer([int(t) for t in row[: int(length)]]), stops)
        return results

    def _answer(self, tokens: list[int]) -> str:
        """A continuation's text after its reasoning: past the last `think_end_token`, as HFLM cuts it."""
        if isinstance(self.think_end_token, int):
            ends = [i for i, token in enumerate(tokens) if token == self.think_end_token]
            if ends:
                return self.tok_decode(tokens[ends[-1] + 1:]).lstrip()
            return self.tok_decode(tokens).lstrip()
        text = self.tok_decode(tokens)
        if self.think_end_token:
            text = text.split(self.think_end_token)[-1].lstrip()
        return text

    def _generation_settings(self, options: Any) -> tuple[tuple[str, ...], int, dict[str, Any]]:
        """(until strings, token budget, Sampling options) from a request's generation arguments."""
        if not isinstance(options, dict):
            raise TypeError(f"generate_until's second argument is a dict of generation settings; got {options!r}.")
        options = dict(options)
        until = options.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        budget = None  # the first of lm-eval's names for it, in its order of priority
        for name in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):
            value = options.pop(name, None)
            if value is not None and budget is None:
                budget = count(int(value), name)
        budget = self.max_gen_toks if budget is None else budget
        temperature = float(options.pop("temperature", 0.0) or 0.0)
        do_sample = options.pop("do_sample", None)
        sampled = bool(do_sample) if do_sample is not None else temperature > 0
        sampling: dict[str, Any] = {"temperature": 0.0}
        if sampled:
            sampling = {"temperature": temperature or 1.0, "top_k": options.pop("top_k", None), "top_p": options.pop("top_p", None)}
        else:
            options.pop("top_k", None), options.pop("top_p", None)
        if options:
            raise ValueError(
                f"generate_until settings {sorted(options)} are not supported by DewLM; it reads until, "
                "max_gen_toks (or max_new_tokens), do_sample, temperature, top_k and top_p."
            )
        if budget >= self.max_length:
            raise ValueError(
                f"max_gen_toks={budget} leaves no room for a context in max_length={self.max_length} tokens; "
                "ask for fewer tokens."
            )
        return tuple(until), budget, sampling

    # --- the forward pass -----------------------------------------------------------------------

    def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability, all greedy) of each continuation after its context, as HFLM
        scores them: the last max_length + 1 tokens of context + continuation, less the final one,
        are the input, and the continuation is read at the input's last positions."""
        rows = []
        for index, (context, continuation) in enumerate(pairs):
            if not context or not continuation:
                raise ValueError(f"request {index}: the context and the continuation must each hold a token; got {len(context)} and {len(continuation)}.")
            if len(continuation) > self.max_length:
                raise ValueError(f"request {index}: its continuation of {len(continuation)} tokens is longer than max_length={self.max_length}.")
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((np.asarray(tokens, np.int32), len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -rows[i][0].size)  # similar widths share a batch
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = padded_width(max(rows[i][0].size - 1 for i in chunk), self.max_length)
            inputs = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            for slot, i in enumerate(chunk):
                tokens = rows[i][0]
                inputs[slot, : tokens.size - 1] = tokens[:-1]
                targets[slot, : tokens.size - 1] = tokens[1:]
            if self._row_sharding is not None:
                import jax

                inputs, targets = (jax.device_put(a, self._row_sharding) for a in (inputs, targets))
            logprobs, greedy = (np.asarray(a) for a in self._score(self.task.variables, inputs, targets))
            for slot, i in enumerate(chunk):
                tokens, length = rows[i]
                end = tokens.size - 1
                span = slice(end - length, end)
                results[i] = (float(logprobs[slot, span].sum()), bool(greedy[slot, span].all()))
        return results


def _score(variables: Any, inputs: Any, targets: Any, *, model: Any):
    """(log-probability of each target, whether it is the argmax), each [rows, width]."""
    import jax
    import jax.numpy as jnp

    logits = model.apply(variables, inputs).astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def _score_function(model: Any):
    """`_score` over `model`, jitted once per process: one compilation per model and input shape."""
    global _score_jit
    if _score_jit is None:
        import jax

        _score_jit = jax.jit(_score, static_argnames="model")
    return functools.partial(_score_jit, model=model)


_score_jit = None


def jax_process_count() -> int:
    import jax

    return jax.process_count()


def row_shards(sharding: Any) -> int:
    """How many ways `sharding` splits the rows (axis 0) of a 2-D array."""
    rows = int(np.prod(list(sharding.mesh.shape.values())))  # divisible by every row split
    return rows // sharding.shard_shape((rows, 1))[0]


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) windows that predict every token of `tokens` once, as lm-eval's
    `get_rolling_token_windows` with context_len=1 and `make_disjoint_window` make them: the first
    window conditions on the prefix token, and each later one on as many earlier tokens as fit."""
    windows = []
    if not tokens:
        return windows
    first = min(max_length, len(tokens))
    windows.append(([prefix_token] + tokens[: first - 1], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        length = min(len(tokens) - predicted, max_length)
        end = predicted + length
        windows.append((tokens[max(end - max_length - 1, 0): end - 1], tokens[end - length: end]))
        predicted = end
    # the disjoint form: the context stops where the continuation starts
    return [(context[: len(context) - (len(continuation) - 1)], continuation) for context, continuation in windows]


def cut_at(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of each stop string in turn (empty strings ignored)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def _args(request: Any, size: int, kind: str) -> tuple:
    args = getattr(request, "args", request)
    if not isinstance(args, tuple) or len(args) != size:
        raise ValueError(f"a {kind} request's args are a tuple of {size}; got {args!r}.")
    return args


__all__ = ["DewLM", "cut_at", "rolling_windows"]
