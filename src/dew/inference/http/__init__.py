"""`dew serve`'s HTTP front end: OpenAI's and Ollama's APIs over one serving engine.

`create_app(engine, name=...)` returns the ASGI app. The front end reads the engine only through
the serving contract (`generate`, `stats`, `start`, `stop`, `task`, `capacity`, `slots`) that
`dew.inference.serving.Server` implements, so its tests can drive it with a scripted engine.
FastAPI and uvicorn come with the `serve` extra.
"""

from __future__ import annotations

from dew._lazy import lazy_getattr

_EXPORTS = {"create_app": "dew.inference.http.app"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
