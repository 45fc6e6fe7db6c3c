"""OpenAI's API: /v1/models, /v1/completions and /v1/chat/completions, plain or streamed.

Requests are validated against the fields this server reads (an unknown field is a 400, not
silently dropped). Besides OpenAI's own sampling fields it reads vLLM's `top_k`, `min_p`,
`stop_token_ids` and `ignore_eos`, so `OpenAICompletion(provider="vllm")` can ask it for any
`Sampling`. Each of `n` continuations is its own engine request, with seed `seed + i` for
continuation i (prompt-major for a list of prompts); without a seed each draws a random one.
Streams are server-sent events ending with `data: [DONE]`. A chat's `response_format` of type
`json_schema` keeps the reply inside the schema (`dew.sampling.guided`, outlines-core): the engine
decodes such a request in its batch with the others, its row masked to the schema's tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dew.inference.http.lifecycle import opened, unless_disconnected
from dew.inference.http.model import APIError, ServedModel, random_seed
from dew.inference.http.pieces import Continuation, merged

MAX_N = 16  # continuations per prompt


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class Sampled(Strict):
    """The settings both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**63)
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_k: int | None = Field(None, ge=-1)  # vLLM's extensions
    min_p: float | None = Field(None, ge=0, le=1)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatRequest(Sampled):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own controls, as vLLM takes them


def _check_unsupported(request: Sampled) -> None:
    for field, off in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(request, field) != off:
            raise APIError(400, f"{field}={getattr(request, field)} is not supported: Dew's sampler applies no "
                                f"penalties; leave it at {off:g}.", field)


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _usage(prompt_tokens: int, completions: Sequence[Continuation]) -> dict:
    drawn = sum(len(c.tokens) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": drawn, "total_tokens": prompt_tokens + drawn}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def router(model: ServedModel, admission: Any) -> Any:
    api = APIRouter(prefix="/v1")

    @api.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": model.created,
                                            "owned_by": "dew"}]}

    @api.get("/models/{name}")
    async def one_model(name: str):
        model.check_name(name)
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "dew"}

    def plan(request: Sampled, prompts: list[list[int]], max_tokens: int | None, param: str):
        """(prompt, budget, sampling, seed) of every continuation, prompt-major."""
        _check_unsupported(request)
        sampling = model.sampling_for(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                                      min_p=request.min_p, stop_token_ids=request.stop_token_ids,
                                      ignore_eos=request.ignore_eos)
        seed = random_seed() if request.seed is None else request.seed
        runs = []
        for i, prompt in enumerate(prompts):
            budget = model.budget(prompt, max_tokens, param)
            runs += [(prompt, budget, sampling, seed + i * request.n + j) for j in range(request.n)]
        return runs

    async def answer(http: Request, request: Sampled, prompts: list[list[int]], runs: list, shape: Any,
                     grammar: Any = None):
        """Run every continuation and answer: one JSON body, or a stream of chunks."""
        stops = _stops(request.stop)
        async with admission.hold(len(runs)) as ticket:
            streams = [model.pieces(prompt, budget, sampling, seed, stops, grammar)
                       for prompt, budget, sampling, seed in runs]
            prompt_tokens = sum(len(p) for p in prompts)
            if not request.stream:
                async def everything():
                    wholes = [Continuation() for _ in runs]
                    async for index, piece in merged(streams):
                        wholes[index].add(piece)
                    return wholes

                wholes = await unless_disconnected(http, everything())
                return shape.body(wholes, _usage(prompt_tokens, wholes))
            chunks = await unless_disconnected(http, opened(merged(streams)))
            ticket.keep()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            try:
                wholes = [Continuation() for _ in runs]
                for index in range(len(runs)):
                    first = shape.first_chunk(index)
                    if first is not None:
                        yield _sse(first)
                async for index, piece in chunks:
                    wholes[index].add(piece)
                    yield _sse(shape.chunk(index, piece))
                if include_usage:
                    yield _sse(shape.usage_chunk(_usage(prompt_tokens, wholes)))
                yield "data: [DONE]\n\n"
            finally:
                await chunks.aclose()
                ticket.release()

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/completions")
    async def completions(request: CompletionRequest, http: Request):
        model.check_name(request.model)
        if request.echo:
            raise APIError(400, "echo=true is not supported; join the prompt to the text yourself.", "echo")
        if request.logprobs:
            raise APIError(400, f"logprobs={request.logprobs} asks for alternatives the engine does not report; "
                                "logprobs=0 returns each drawn token's log-probability.", "logprobs")
        prompts = _prompts(model, request.prompt)
        runs = plan(request, prompts, request.max_tokens, "max_tokens")
        return await answer(http, request, prompts, runs, CompletionShape(model, request))

    @api.post("/chat/completions")
    async def chat(request: ChatRequest, http: Request):
        model.check_name(request.model)
        if request.top_logprobs:
            raise APIError(400, f"top_logprobs={request.top_logprobs} asks for alternatives the engine does not "
                                "report; logprobs=true alone returns each drawn token's log-probability.",
                           "top_logprobs")
        grammar = _response_grammar(model, request.response_format)
        messages = [_message(m) for m in request.messages]
        prompts = [model.chat_prompt(messages, request.tools, request.chat_template_kwargs)]
        max_tokens = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        runs = plan(request, prompts, max_tokens, param)
        return await answer(http, request, prompts, runs, ChatShape(model, request), grammar)

    return api


def _response_grammar(model: ServedModel, response_format: dict | None) -> Any:
    """The grammar `response_format` asks for: None for text, a JSON schema's grammar for json_schema."""
    kind = None if response_format is None else response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind != "json_schema":
        raise APIError(400, f"response_format type {kind!r} is not supported; use 'text' or 'json_schema' with a "
                            "schema.", "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise APIError(400, "response_format.json_schema must be an object holding the schema under 'schema'.",
                       "response_format.json_schema")
    return model.grammar(spec["schema"], "response_format.json_schema.schema")


def _prompts(model: ServedModel, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [model.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty.", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [model.encode(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [model.token_ids(prompt)]
    return [model.token_ids(p) for p in prompt]


def _message(message: Message) -> dict:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    record = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
    if message.tool_calls:
        record["tool_calls"] = message.tool_calls
    if message.name:
        record["name"] = message.name
    return record


class CompletionShape:
    """The bodies and chunks of /v1/completions."""

    def __init__(self, model: ServedModel, request: CompletionRequest):
        self.model, self.request = model, request
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def logprobs(self, tokens: list[int], logprobs: list[float]) -> dict | None:
        if self.request.logprobs is None:
            return None
        texts = [self.model.token_text(t) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    def head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model.name}

    def body(self, wholes: list[Continuation], usage: dict) -> dict:
        choices = [{"index": i, "text": c.text, "logprobs": self.logprobs(c.tokens, c.logprobs),
                    "finish_reason": c.finish_reason} for i, c in enumerate(wholes)]
        return {**self.head(), "choices": choices, "usage": usage}

    def first_chunk(self, index: int) -> None:
        return None

    def chunk(self, index: int, piece: Any) -> dict:
        choice = {"index": index, "text": piece.text, "logprobs": self.logprobs(piece.tokens, piece.logprobs),
                  "finish_reason": piece.finish_reason}
        return {**self.head(), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.head(), "choices": [], "usage": usage}


class ChatShape(CompletionShape):
    """The bodies and chunks of /v1/chat/completions."""

    def __init__(self, model: ServedModel, request: ChatRequest):
        super().__init__(model, request)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"

    def logprobs(self, tokens: list[int], logprobs: list[float]) -> dict | None:
        if not self.request.logprobs:
            return None
        content = []
        for token, logprob in zip(tokens, logprobs):
            text = self.model.token_text(token)
            content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}

    def head(self, chunk: bool = False) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": self.created, "model": self.model.name}

    def body(self, wholes: list[Continuation], usage: dict) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c.tokens, c.logprobs), "finish_reason": c.finish_reason}
                   for i, c in enumerate(wholes)]
        return {**self.head(), "choices": choices, "usage": usage}

    def first_chunk(self, index: int) -> dict:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self.head(chunk=True), "choices": [choice]}

    def chunk(self, index: int, piece: Any) -> dict:
        choice = {"index": index, "delta": {"content": piece.text},
                  "logprobs": self.logprobs(piece.tokens, piece.logprobs), "finish_reason": piece.finish_reason}
        return {**self.head(chunk=True), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.head(chunk=True), "choices": [], "usage": usage}
