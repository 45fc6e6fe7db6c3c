"""`dew serve`'s HTTP front end: OpenAI's and Ollama's APIs over one serving engine.

`create_app(engine, name=...)` returns the ASGI app. The front end reads the engine only through
the serving contract (`generate`, `stats`, `start`, `stop`, `task`, `capacity`, `slots`), so it runs
over `dew.inference.serving.Server` or `dew.inference.serving_static.StaticServer` alike.
FastAPI and uvicorn come with the `serve` extra.
"""

from __future__ import annotations

from dew._lazy import lazy_getattr

_EXPORTS = {"create_app": "dew.inference.http.app"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
