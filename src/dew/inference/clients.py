"""Completions from a served model through the vendors' own SDK clients: OpenAI's and Ollama's.

`OpenAICompletion(model, client, provider=None)` wraps an `openai.OpenAI` client and
`OllamaCompletion(model, client)` an `ollama.Client`; the user creates the client (its address,
key, timeouts). ``completion(prompts, max_new_tokens, sampling=Sampling(...), key=0, raw=True)``
asks for the settings local generation would use and returns a `Completion`. A setting the backend
cannot take raises instead of being dropped: a generic OpenAI endpoint takes no top_k, min_p or EOS
ids (vLLM and SGLang do, with `provider=`), and Ollama's API takes no token ids. The backends' own
penalties and extra filters are turned off, so temperature 0 draws the greedy tokens.

`raw=True` sends each prompt as it is (OpenAI's completion endpoint, Ollama's raw mode);
`raw=False` sends it as a user turn that the server wraps in the model's chat template.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from dew.sampling.text import Sampling

PROVIDERS = (None, "vllm", "sglang")


@dataclasses.dataclass(frozen=True)
class Completion:
    """What a served model returned, one entry per prompt.

    Attributes:
      texts: the generated text of each prompt.
      finish_reasons: why each ended, as the backend says it ("stop", "length").
      token_counts: the tokens the backend drew for each.
      usage: prompt_tokens, completion_tokens and total_tokens over all prompts.
      responses: the SDK's response objects, unchanged (the backend's own metadata).
    """

    texts: list[str]
    finish_reasons: list[str | None]
    token_counts: list[int]
    usage: dict[str, int]
    responses: list[Any]


def _prompts(prompts: str | Sequence[str]) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a string or a non-empty list of strings.")
    return prompts


def _seed(key: Any) -> int | None:
    """The backend's seed: an int as it is, a JAX key drawn down to 31 bits, None for no seed."""
    if key is None or (isinstance(key, numbers.Integral) and not isinstance(key, bool)):
        return None if key is None else int(key)
    import jax

    return int(jax.random.randint(key, (), 0, 2**31 - 1))


def _count(value: Any, name: str) -> int:
    from dew.checks import count

    return count(value, name)


def _usage(counts: Sequence[tuple[int, int]]) -> dict[str, int]:
    prompt = sum(p for p, _ in counts)
    drawn = sum(d for _, d in counts)
    return {"prompt_tokens": prompt, "completion_tokens": drawn, "total_tokens": prompt + drawn}


class OpenAICompletion:
    """Completions from an OpenAI-compatible server through an `openai.OpenAI` client.

    `provider="vllm"` or `"sglang"` sends the controls those servers read beyond OpenAI's schema
    (top_k, min_p, stop_token_ids with ignore_eos, repetition_penalty=1); `dew serve` reads them too.
    """

    def __init__(self, model: str, client: Any, provider: str | None = None):
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}; got {provider!r}.")
        if not hasattr(client, "completions") or not hasattr(client, "chat"):
            raise TypeError(f"client must be an openai.OpenAI client; got {type(client).__name__}.")
        self.model, self.client, self.provider = model, client, provider

    def options(self, sampling: Sampling) -> tuple[dict[str, Any], dict[str, Any]]:
        """The OpenAI fields and the provider's extra fields that ask for `sampling`."""
        fields = {"temperature": sampling.temperature, "top_p": 1.0 if sampling.top_p is None else sampling.top_p}
        if self.provider is None:
            asked = {name: value for name, value in (("top_k", sampling.top_k), ("min_p", sampling.min_p),
                                                     ("eos_token_ids", sampling.eos_token_ids or None))
                     if value is not None}
            if asked:
                raise ValueError(
                    f"Sampling sets {sorted(asked)}, which a generic OpenAI endpoint does not accept; pass "
                    "provider='vllm' or 'sglang' for a server that does, or leave them unset."
                )
            return fields, {}
        extra = {"top_k": -1 if sampling.top_k is None else sampling.top_k,
                 "min_p": 0.0 if sampling.min_p is None else sampling.min_p,
                 "stop_token_ids": list(sampling.eos_token_ids), "ignore_eos": True, "repetition_penalty": 1.0}
        return fields, extra

    def __call__(self, prompts: str | Sequence[str], max_new_tokens: int, *, sampling: Sampling = Sampling(),
                 key: Any = None, raw: bool = False) -> Completion:
        """One completion per prompt, each drawing at most `max_new_tokens` tokens with `sampling`
        (seeded by `key`: an int or a JAX key)."""
        budget = _count(max_new_tokens, "max_new_tokens")
        fields, extra = self.options(sampling)
        seed = _seed(key)
        if seed is not None:
            fields["seed"] = seed
        if extra:
            fields["extra_body"] = extra
        texts, reasons, counts, responses = [], [], [], []
        for prompt in _prompts(prompts):
            if raw:
                response = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=budget, **fields)
                texts.append(response.choices[0].text)
            else:
                response = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=budget, **fields)
                texts.append(response.choices[0].message.content or "")
            reasons.append(response.choices[0].finish_reason)
            counts.append((response.usage.prompt_tokens, response.usage.completion_tokens))
            responses.append(response)
        return Completion(texts, reasons, [d for _, d in counts], _usage(counts), responses)


class OllamaCompletion:
    """Completions from an Ollama server (or `dew serve`) through an `ollama.Client`."""

    def __init__(self, model: str, client: Any):
        if not hasattr(client, "generate"):
            raise TypeError(f"client must be an ollama.Client; got {type(client).__name__}.")
        self.model, self.client = model, client

    @staticmethod
    def options(sampling: Sampling) -> dict[str, Any]:
        """Ollama's options asking for `sampling`, with its penalties and other samplers off."""
        if sampling.eos_token_ids:
            raise ValueError(
                f"Sampling sets eos_token_ids={sampling.eos_token_ids}, but Ollama's API takes no token ids (its "
                "model's own end token ends a continuation); leave them unset, or end on text with a stop string."
            )
        return {"temperature": sampling.temperature, "top_p": 1.0 if sampling.top_p is None else sampling.top_p,
                "top_k": 0 if sampling.top_k is None else sampling.top_k,
                "min_p": 0.0 if sampling.min_p is None else sampling.min_p,
                "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "mirostat": 0}

    def __call__(self, prompts: str | Sequence[str], max_new_tokens: int, *, sampling: Sampling = Sampling(),
                 key: Any = None, raw: bool = False) -> Completion:
        """One completion per prompt, each drawing at most `max_new_tokens` tokens with `sampling`
        (seeded by `key`: an int or a JAX key)."""
        options = {**self.options(sampling), "num_predict": _count(max_new_tokens, "max_new_tokens")}
        seed = _seed(key)
        if seed is not None:
            options["seed"] = seed
        texts, reasons, counts, responses = [], [], [], []
        for prompt in _prompts(prompts):
            response = self.client.generate(model=self.model, prompt=prompt, raw=raw, options=options, stream=False)
            texts.append(response.response or "")
            reasons.append(response.done_reason)
            counts.append((response.prompt_eval_count or 0, response.eval_count or 0))
            responses.append(response)
        return Completion(texts, reasons, [d for _, d in counts], _usage(counts), responses)


__all__ = ["Completion", "OllamaCompletion", "OpenAICompletion"]
