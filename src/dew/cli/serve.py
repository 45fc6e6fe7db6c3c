"""`dew serve SOURCE`: a decoder behind OpenAI's and Ollama's HTTP APIs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import tyro
from tyro.conf import Positional


def run(
    source: Positional[Annotated[str, tyro.conf.arg(metavar="SOURCE")]],
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    slots: int = 8,
    capacity: int | None = None,
    max_in_flight: int | None = None,
    page_size: int | None = None,
    pages: int | None = None,
    kv_cache: Literal["dense", "int8", "float8"] = "dense",
    chunk: int | None = None,
    prefix_cache: bool = False,
    decode_steps: int = 1,
    step: int | None = None,
    live: bool = False,
    dtype: str | None = None,
    log_level: str = "warning",
) -> None:
    """Serve a decoder over HTTP: OpenAI's /v1/models, /v1/completions and /v1/chat/completions,
    Ollama's /api/generate, /api/chat and /api/tags, and /health and /metrics.

    Args:
        source: A saved run, a Hugging Face checkpoint directory or a Hub repository id (anything
            dew.pipeline reads).
        host: The address to listen on.
        port: The port to listen on.
        name: The model name clients ask for (default: the source's last path component).
        slots: Rows decoding at once.
        capacity: Tokens per request, prompt and continuation together (default: the model's
            max_seq_len).
        max_in_flight: Continuations running or waiting before a request is refused with 429
            (default: four per slot).
        page_size: Tokens per page of a paged KV cache.
        pages: Pages in the paged cache's pool.
        kv_cache: How the cache stores keys and values: "dense" (the compute dtype), "int8" or "float8".
        chunk: Prefill long prompts this many tokens per step (needs a paged cache).
        prefix_cache: Share the pages of prompts that begin alike (needs a paged cache).
        decode_steps: Decode iterations per device call. More spreads each call's fixed cost over
            more tokens (on a GPU, where a step takes well under a millisecond, 8 served 3.6x the
            tokens per second of 1); tokens then stream in bursts of this many, and waiting
            requests are admitted between calls.
        step: Which checkpoint step of a saved run (default: the newest).
        live: Serve a saved run's live weights instead of its EMA copy (needed for a run that
            keeps no EMA).
        dtype: The compute dtype (default: the source's).
        log_level: uvicorn's log level.
    """
    try:
        import uvicorn
    except ImportError:
        raise ImportError("dew serve needs FastAPI and uvicorn: pip install 'dewml[serve]'.") from None
    import dew
    from dew.checks import count
    from dew.inference.http import create_app
    from dew.inference.serving import Server

    count(port, "port")
    task = dew.pipeline(source, step=step, dtype=dtype, ema=not live)
    if not hasattr(task, "model") or not hasattr(task.model, "init_cache"):
        raise ValueError(f"{source} serves a {type(task).__name__}; dew serve serves decoders (TextGeneration).")
    options = {}
    layout = cache_layout(kv_cache, page_size=page_size, pages=pages)
    if layout is not None:
        options["kv_cache"] = layout
    if chunk is not None:
        options["chunk"] = chunk
    if prefix_cache:
        options["prefix_cache"] = True
    capacity = task.model.max_seq_len if capacity is None else capacity
    engine = Server.from_task(task, slots=slots, capacity=capacity, decode_steps=decode_steps, **options)
    name = name or Path(str(source).rstrip("/")).name
    app = create_app(engine, name=name, max_in_flight=max_in_flight)
    pool = f", a pool of {engine.pages} pages of {engine.page_size} tokens" if engine.paged else ""
    print(f"dew serve: {name} on http://{host}:{port} ({engine.slots} slots of {engine.capacity} tokens{pool})",
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


QUANTIZED = {"dense": None, "int8": "int8", "float8": "float8_e4m3fn"}  # --kv-cache -> KVCache(quantized=)


def cache_layout(kv_cache: str, *, page_size: int | None = None, pages: int | None = None):
    """The `KVCache` layout `--kv-cache`, `--page-size` and `--pages` ask for (None: the dense default)."""
    if kv_cache not in QUANTIZED:
        raise ValueError(f"--kv-cache {kv_cache!r} is not a cache format; use one of {', '.join(QUANTIZED)}")
    paging = {name: value for name, value in (("page_size", page_size), ("pages", pages)) if value is not None}
    if not paging and kv_cache == "dense":
        return None
    from dew.nn.kv_cache import KVCache

    return KVCache(quantized=QUANTIZED[kv_cache], **paging)
