"""The ASGI application `dew serve` runs: the OpenAI and Ollama APIs over one engine.

`create_app(engine, name=...)` builds a FastAPI app around an engine that follows the serving
contract. Both APIs share its `ServedModel`, an `Admission` bound on the requests in flight (one
more answers 429, so the queue never grows without bound), and the error handlers that answer in
each API's schema: `{"error": {"message", "type", "param", "code"}}` under /v1, `{"error": message}`
under /api. `/health` says whether the engine is up; `/metrics` reports the engine's queue depth,
running rows, tokens/s, cache pages and prompt tokens (all, and those read from the prefix cache),
and the requests in flight and refused, in Prometheus' text format.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dew.inference.http.lifecycle import Admission, ClientGone
from dew.inference.http.model import APIError, ServedModel, validation_error


def create_app(engine: Any, *, name: str, max_in_flight: int | None = None) -> Any:
    """A FastAPI app serving `engine`'s task as model `name`.

    `max_in_flight` bounds the continuations running or waiting (default: four per slot); a request
    past it gets 429.
    """
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse
    except ImportError:
        raise ImportError("dew serve needs FastAPI and uvicorn: pip install 'dewml[serve]'.") from None

    from dew.inference.http import ollama_api, openai_api

    model = ServedModel.from_engine(engine, name)
    admission = Admission(max_in_flight or 4 * int(getattr(engine, "slots", 1)))
    state = {"up": False}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()
        state["up"] = True
        try:
            yield
        finally:
            state["up"] = False
            await engine.stop()

    app = FastAPI(title=f"dew serve: {name}", lifespan=lifespan)

    def error_response(request: Request, error: APIError) -> Any:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": error.message}, status_code=error.status)
        body = {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse({"error": body}, status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def refused(request: Request, error: APIError):
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, error: RequestValidationError):
        return error_response(request, validation_error(error.errors()))

    @app.exception_handler(ValueError)
    async def engine_refused(request: Request, error: ValueError):  # the engine's own checks
        return error_response(request, APIError(400, str(error)))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, error: ClientGone):  # nobody reads it; the rows are already free
        return JSONResponse({"error": "the client closed the connection"}, status_code=499)

    @app.get("/health")
    async def health():
        if not state["up"]:
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok", "model": name}

    @app.get("/metrics")
    async def metrics():
        lines = []
        figures = {**{key: float(value) for key, value in engine.stats().items()},
                   "requests_in_flight": float(admission.in_flight),
                   "requests_refused_total": float(admission.refused)}
        for key, value in figures.items():
            kind = "counter" if key.endswith("_total") else "gauge"
            lines += [f"# TYPE dew_{key} {kind}", f"dew_{key} {value:g}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    app.include_router(openai_api.router(model, admission))
    app.include_router(ollama_api.router(model, admission))
    return app

