"""Ollama's API: /api/generate, /api/chat and /api/tags, streamed as JSON lines or answered whole.

A generate request without `raw` renders its prompt (and `system`) as a user turn through the
checkpoint's chat template, as Ollama applies a model's template; `raw=true`, or a tokenizer
without a template, sends the prompt as it is. Sampling starts from the checkpoint's defaults, not
Ollama's own (temperature 0.8, top_k 40, a repeat penalty), and `options` set over them; options
that only place or size Ollama's runner (`num_ctx`, `num_gpu`, `num_thread`, ...) are accepted and
have no effect, and a penalty or sampler Dew does not implement is refused. A JSON schema as
`format` keeps the reply inside it, as on OpenAI's side. As in Ollama, `stream` defaults to true.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dew.inference.http.lifecycle import opened, unless_disconnected
from dew.inference.http.model import APIError, ServedModel, random_seed, validation_error
from dew.inference.http.pieces import Continuation


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(Strict):
    # placing and sizing the runner: no effect here
    numa: bool | None = None
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    # sampling
    seed: int | None = Field(None, ge=-2**63, lt=2**63)
    num_predict: int | None = None
    top_k: int | None = None
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    temperature: float | None = Field(None, ge=0)
    stop: list[str] | None = None
    # what Dew's sampler does not do: accepted only when switched off
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None


_OFF = {"tfs_z": 1.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "mirostat": 0}


class Generated(Strict):
    model: str
    stream: bool = True
    options: Options | None = None
    format: Any = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class GenerateRequest(Generated):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict] | None = None
    tool_name: str | None = None


class ChatRequest(Generated):
    messages: list[Message] | None = None
    tools: list[dict] | None = None


def _refuse_unsupported(request: Generated, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        if value not in (None, False, "", []):
            raise APIError(400, f"{name} is not supported by this server; leave it out.", name)
    if request.format not in (None, "") and not isinstance(request.format, dict):
        raise APIError(400, f"format={request.format!r} is not supported; pass a JSON schema object.", "format")
    if request.think not in (None, False):
        raise APIError(400, "think is not supported: this model has no thinking mode.", "think")
    if request.top_logprobs:
        raise APIError(400, "top_logprobs asks for alternatives the engine does not report; logprobs=true alone "
                            "returns each drawn token's log-probability.", "top_logprobs")
    options = request.options or Options()
    for name, off in _OFF.items():
        value = getattr(options, name)
        if value is not None and value != off:
            raise APIError(400, f"options.{name}={value} is not supported: Dew's sampler does not implement it; "
                                f"leave it out or set {off:g}.", f"options.{name}")


async def _read(http: Request, schema: type[BaseModel]) -> Any:
    """The request body as `schema`, whatever its content type says (Ollama reads every body as JSON)."""
    try:
        return schema.model_validate_json(await http.body())
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def router(model: ServedModel, admission: Any) -> Any:
    api = APIRouter(prefix="/api")

    @api.get("/tags")
    async def tags():
        created = datetime.datetime.fromtimestamp(model.created, datetime.timezone.utc).isoformat()
        return {"models": [{"name": model.name, "model": model.name, "modified_at": created, "size": 0,
                            "digest": "", "details": {"format": "dew", "family": "", "parameter_size": "",
                                                      "quantization_level": ""}}]}

    @api.get("/version")
    async def version():
        return {"version": "0.0.0-dew"}

    async def answer(http: Request, request: Generated, prompt: list[int], shape: Any):
        options = request.options or Options()
        sampling = model.sampling_for(temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
                                      min_p=options.min_p)
        wanted = options.num_predict if options.num_predict is not None and options.num_predict >= 0 else None
        if wanted == 0:
            raise APIError(400, "options.num_predict=0 asks for no tokens; ask for at least 1 (or -1 for as many "
                                "as fit).", "options.num_predict")
        budget = model.budget(prompt, wanted, "options.num_predict")
        seed = random_seed() if options.seed is None else options.seed
        grammar = model.grammar(request.format, "format") if isinstance(request.format, dict) else None
        started = time.monotonic_ns()
        async with admission.hold(1) as ticket:
            pieces = model.pieces(prompt, budget, sampling, seed, options.stop or (), grammar)
            if not request.stream:
                async def everything():
                    whole = Continuation()
                    async for piece in pieces:
                        whole.add(piece)
                    return whole

                whole = await unless_disconnected(http, everything())
                return {**shape.piece(whole.text, request.logprobs and whole), **shape.done(whole, prompt, started)}
            stream = await unless_disconnected(http, opened(pieces))
            ticket.keep()

        async def lines() -> AsyncIterator[str]:
            whole = Continuation()
            try:
                async for piece in stream:
                    whole.add(piece)
                    if piece.text:
                        yield json.dumps(shape.piece(piece.text, request.logprobs and piece)) + "\n"
                yield json.dumps({**shape.piece("", None), **shape.done(whole, prompt, started)}) + "\n"
            finally:
                await stream.aclose()
                ticket.release()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @api.post("/generate")
    async def generate(http: Request):
        request = await _read(http, GenerateRequest)
        model.check_name(request.model)
        _refuse_unsupported(request, {"suffix": request.suffix, "template": request.template,
                                      "context": request.context, "images": request.images, "width": request.width,
                                      "height": request.height, "steps": request.steps})
        shape = GenerateShape(model)
        if not request.prompt:  # Ollama's way to load a model: nothing to generate
            return {**shape.piece("", None), "done": True, "done_reason": "load"}
        if request.raw or not getattr(model.tokenizer, "chat_template", None):
            prompt = model.encode(request.prompt)
        else:
            turns = ([{"role": "system", "content": request.system}] if request.system else [])
            prompt = model.chat_prompt(turns + [{"role": "user", "content": request.prompt}])
        return await answer(http, request, prompt, shape)

    @api.post("/chat")
    async def chat(http: Request):
        request = await _read(http, ChatRequest)
        model.check_name(request.model)
        images = [m.images for m in request.messages or [] if m.images]
        _refuse_unsupported(request, {"messages.images": images})
        shape = ChatShape(model)
        if not request.messages:
            return {**shape.piece("", None), "done": True, "done_reason": "load"}
        messages = []
        for m in request.messages:
            record = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                record["tool_calls"] = m.tool_calls
            messages.append(record)
        return await answer(http, request, model.chat_prompt(messages, request.tools), shape)

    return api


class GenerateShape:
    """The lines and bodies of /api/generate."""

    def __init__(self, model: ServedModel):
        self.model = model

    def logprobs(self, drawn: Any) -> list[dict] | None:
        if not drawn:
            return None
        return [{"token": self.model.token_text(t), "logprob": lp, "top_logprobs": []}
                for t, lp in zip(drawn.tokens, drawn.logprobs)]

    def piece(self, text: str, drawn: Any) -> dict:
        body = {"model": self.model.name, "created_at": _now(), "response": text, "done": False}
        if drawn:
            body["logprobs"] = self.logprobs(drawn)
        return body

    def done(self, whole: Continuation, prompt: list[int], started: int) -> dict:
        spent = time.monotonic_ns() - started
        return {"done": True, "done_reason": whole.finish_reason, "total_duration": spent, "load_duration": 0,
                "prompt_eval_count": len(prompt), "prompt_eval_duration": 0, "eval_count": len(whole.tokens),
                "eval_duration": spent}


class ChatShape(GenerateShape):
    """The lines and bodies of /api/chat."""

    def piece(self, text: str, drawn: Any) -> dict:
        body = {"model": self.model.name, "created_at": _now(), "message": {"role": "assistant", "content": text},
                "done": False}
        if drawn:
            body["logprobs"] = self.logprobs(drawn)
        return body
