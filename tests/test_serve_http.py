"""The HTTP front end of `dew serve` over a scripted engine: text pieces, stop strings and EOS,
continuations and their seeds, each API's error schema, the bounded queue, and clients that leave.

The engine here follows the serving contract but draws no model: a request with seed s spells
SCRIPTS[s % 3] one character per token, then an EOS token, and each token waits while the test
withholds tokens, so the timing of every request is the test's to choose. A real uvicorn server runs
the app in a thread on a free loopback port.
"""

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from dew.inference.http.pieces import Detokenizer, held_back, text_pieces
from dew.inference.serving import TokenEvent
from dew.sampling import Sampling

SCRIPTS = ["the cat sat", "a dog ran", "owls hoot"]
EOS = 0


class Letters:
    """A tokenizer of lowercase letters (ids 1-26) and space (27); id 0 is the end token."""

    chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% if terse %}brief {% endif %}{% endif %}")

    def encode(self, text):
        return [27 if c == " " else ord(c) - 96 for c in text if c == " " or c.isalpha()]

    def decode(self, ids):
        return "".join(" " if i == 27 else chr(i + 96) for i in ids if i != EOS)


class ScriptedEngine:
    """The serving contract over SCRIPTS; counts the requests it opened and closed."""

    slots = 2
    capacity = 64

    def __init__(self):
        self.task = SimpleNamespace(processor=SimpleNamespace(tokenizer=Letters()),
                                    sampling=Sampling(temperature=0.0, eos_token_ids=(EOS,)),
                                    model=SimpleNamespace(vocab_size=28))
        self.allowance = None  # tokens the engine may still yield; None: no limit
        self.opened = self.closed = 0
        self.requests = []

    async def start(self):
        pass

    async def stop(self):
        pass

    def stats(self):
        return {"queue_depth": 0.0, "running": float(self.opened - self.closed), "tokens_per_second": 0.0,
                "pages_used": 0.0, "prompt_tokens_total": 0.0, "prompt_tokens_cached_total": 0.0}

    async def generate(self, prompt, *, max_new_tokens, sampling, seed):
        if len(prompt) + max_new_tokens > self.capacity:
            raise ValueError("too long for the scripted engine")
        self.opened += 1
        self.requests.append(dict(prompt=list(prompt), budget=max_new_tokens, sampling=sampling, seed=seed))
        try:
            tokens = Letters().encode(SCRIPTS[seed % len(SCRIPTS)]) + [EOS]
            for i, token in enumerate(tokens[:max_new_tokens]):
                while self.allowance == 0:
                    await asyncio.sleep(0.01)
                if self.allowance is not None:
                    self.allowance -= 1
                ended = token in sampling.eos_token_ids
                last = i == max_new_tokens - 1
                yield TokenEvent(token, -0.5, "stop" if ended else ("length" if last else None))
                if ended:
                    return
        finally:
            self.closed += 1


@pytest.fixture(scope="module")
def served():
    import uvicorn

    from dew.inference.http import create_app

    engine = ScriptedEngine()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, name="scripted", max_in_flight=3),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engine=engine)
    server.should_exit = True
    thread.join(10)


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def post(served, path, body, **options):
    return httpx.post(served.url + path, json=body, timeout=options.pop("timeout", 10), **options)


# --- pieces -------------------------------------------------------------------------------------


def test_held_back_keeps_a_partial_character_and_the_start_of_a_stop_string():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("ab\ufffd", []) == 1
    assert held_back("hello w", ["xyz", "wo", "lo wx"]) == 4  # the longest tail that can still grow


def test_the_detokenizer_adds_whole_characters_and_keeps_the_space_a_lone_token_would_lose():
    from pathlib import Path

    from dew.data import HFTokenizer

    tokenizer = HFTokenizer(Path(__file__).parent / "fixtures" / "tokenizers" / "tiny-tools")
    ids = tokenizer.encode("héllo wörld ✓ 日本 done")
    text_of = Detokenizer(tokenizer.decode)
    seen = [text_of.add(i) for i in ids]
    assert all("\ufffd" not in text for text in seen)  # a split character waits for its last byte
    assert text_of.finish() == tokenizer.decode(ids) == "héllo wörld ✓ 日本 done"
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the control: some tokens are partial bytes

    pieces = {1: "\u2581the", 2: "\u2581cat"}  # SentencePiece drops the leading space of a text
    spaced = Detokenizer(lambda ids: "".join(pieces[i] for i in ids).replace("\u2581", " ").lstrip(" "))
    assert [spaced.add(1), spaced.add(2)] == ["the", "the cat"]


def test_text_pieces_end_at_a_stop_string_across_tokens_and_close_the_engine_iterator():
    closed = []

    async def events():
        try:
            for i, token in enumerate(Letters().encode("the cat sat")):
                yield TokenEvent(token, -1.0, None)
        finally:
            closed.append(True)

    async def run(stops):
        return [piece async for piece in text_pieces(events(), Letters().decode, stops)]

    pieces = asyncio.run(run(["cat"]))
    assert "".join(p.text for p in pieces) == "the "
    assert all("c" not in p.text for p in pieces)  # "c" might have begun "cat", so it was never sent
    assert pieces[-1].finish_reason == "stop" and closed == [True]
    assert sum(len(p.tokens) for p in pieces) == 7  # drawn up to the "t" that completed the stop string
    unstopped = asyncio.run(run([]))
    assert "".join(p.text for p in unstopped) == "the cat sat"  # the control: no stop, the whole text
    assert unstopped[-1].finish_reason == "length"


# --- OpenAI's API -------------------------------------------------------------------------------


def test_completions_leave_out_the_eos_token_count_it_and_stop_on_budget_or_stop_strings(served):
    whole = post(served, "/v1/completions", {"model": "scripted", "prompt": "hi", "seed": 0, "max_tokens": 20}).json()
    assert whole["choices"][0]["text"] == "the cat sat" and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}
    short = post(served, "/v1/completions", {"model": "scripted", "prompt": "hi", "seed": 0, "max_tokens": 3}).json()
    assert short["choices"][0]["text"] == "the" and short["choices"][0]["finish_reason"] == "length"
    stopped = post(served, "/v1/completions", {"model": "scripted", "prompt": "hi", "seed": 0, "stop": ["sat", "x"],
                                               "logprobs": 0}).json()["choices"][0]
    assert stopped["text"] == "the cat " and stopped["finish_reason"] == "stop"
    assert stopped["logprobs"]["token_logprobs"] == [-0.5] * 11 and stopped["logprobs"]["tokens"][:3] == list("the")


def test_n_continuations_take_seeds_seed_plus_i_and_stream_the_same_text(served):
    body = {"model": "scripted", "prompt": "hi", "seed": 1, "n": 2, "max_tokens": 20}
    whole = post(served, "/v1/completions", body).json()
    assert [c["text"] for c in whole["choices"]] == [SCRIPTS[1], SCRIPTS[2]]
    texts = {0: "", 1: ""}
    usage = None
    with httpx.stream("POST", served.url + "/v1/completions", timeout=10,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
        usage = chunk.get("usage") or usage
    assert texts == {0: SCRIPTS[1], 1: SCRIPTS[2]}
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == len(SCRIPTS[1]) + len(SCRIPTS[2]) + 2


def test_chat_renders_the_template_and_applies_request_sampling_over_the_defaults(served):
    served.engine.requests.clear()
    reply = post(served, "/v1/chat/completions", {
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}], "seed": 2, "temperature": 0.5,
        "top_p": 0.9, "max_tokens": 30}).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": SCRIPTS[2]}
    request = served.engine.requests[-1]
    assert Letters().decode(request["prompt"]) == "userhiassistant"  # "<user>hi<assistant>", letters only
    assert request["sampling"] == Sampling(temperature=0.5, top_p=0.9, eos_token_ids=(EOS,))
    assert request["budget"] == 30

    # The template's own controls pass through (vLLM's chat_template_kwargs); one it does not read is a 400.
    post(served, "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4, "chat_template_kwargs": {"terse": True}})
    assert Letters().decode(served.engine.requests[-1]["prompt"]) == "userhiassistantbrief "
    refused = post(served, "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": "hi"}],
                                                    "chat_template_kwargs": {"enable_thinking": False}})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "chat_template_kwargs"
    assert "reads no enable_thinking; the controls it reads are: terse" in error["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "hi"}, 404, "model"),
    ({"model": "scripted", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "scripted", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "scripted", "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"model": "scripted", "prompt": "hi", "colour": "blue"}, 400, "colour"),
    ({"model": "scripted", "prompt": "hi " * 17}, 400, "max_tokens"),  # 51 prompt tokens + 16 > 64
    ({"model": "scripted", "prompt": "hi " * 22, "max_tokens": None}, 400, "prompt"),  # 66 > 64
    ({"model": "scripted", "prompt": [3, 99]}, 400, "prompt"),
    ({"model": "scripted", "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "scripted", "prompt": "hi", "n": 4}, 400, "n"),  # more than the server ever admits at once
])
def test_openai_errors_use_its_schema_and_name_the_field(served, body, status, param):
    response = post(served, "/v1/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status and param in error["message"]


def test_malformed_json_is_a_400_in_each_schema(served):
    response = httpx.post(served.url + "/v1/completions", content=b'{"model": "scripted",',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(served.url + "/api/generate", content=b'{"model": ')
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]


# --- Ollama's API -------------------------------------------------------------------------------


def test_ollama_generate_streams_json_lines_by_default_and_answers_whole_on_request(served):
    body = {"model": "scripted", "prompt": "hi", "raw": True, "options": {"seed": 1, "stop": ["ran"]}}
    whole = post(served, "/api/generate", {**body, "stream": False}).json()
    assert whole["response"] == "a dog " and whole["done"] and whole["done_reason"] == "stop"
    with httpx.stream("POST", served.url + "/api/generate", json=body, timeout=10) as response:
        import json

        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["response"] for line in lines) == "a dog " and lines[-1]["done"]
    assert lines[-1]["eval_count"] == whole["eval_count"] == 9 and not any(line["done"] for line in lines[:-1])
    chat = post(served, "/api/chat", {"model": "scripted", "messages": [{"role": "user", "content": "x"}],
                                      "stream": False, "options": {"seed": 0, "num_predict": 3}}).json()
    assert chat["message"] == {"role": "assistant", "content": "the"} and chat["done_reason"] == "length"


@pytest.mark.parametrize("body, status, words", [
    ({"model": "other", "prompt": "hi"}, 404, "other"),
    ({"model": "scripted", "prompt": "hi", "options": {"repeat_penalty": 1.1}}, 400, "repeat_penalty"),
    ({"model": "scripted", "prompt": "hi", "options": {"warmth": 1}}, 400, "warmth"),
    ({"model": "scripted", "prompt": "hi", "options": {"num_predict": 500}}, 400, "num_predict"),
    ({"model": "scripted", "prompt": "hi", "images": ["aGk="]}, 400, "images"),
])
def test_ollama_errors_are_an_error_string_with_a_4xx(served, body, status, words):
    response = post(served, "/api/generate", body)
    assert response.status_code == status and words in response.json()["error"]


def test_tags_models_health_and_metrics(served):
    assert [m["name"] for m in httpx.get(served.url + "/api/tags").json()["models"]] == ["scripted"]
    assert [m["id"] for m in httpx.get(served.url + "/v1/models").json()["data"]] == ["scripted"]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(served.url + "/metrics").text
    for name in ("dew_queue_depth", "dew_running", "dew_tokens_per_second", "dew_pages_used", "dew_requests_in_flight",
                 "dew_prompt_tokens_total", "dew_prompt_tokens_cached_total"):
        assert f"\n{name} " in "\n" + metrics
    assert "# TYPE dew_prompt_tokens_cached_total counter" in metrics


# --- load and departures ------------------------------------------------------------------------


def test_a_full_server_answers_429_and_serves_the_held_requests_after(served):
    served.engine.allowance = 0
    results = {}

    def ask(name, body):
        results[name] = post(served, "/v1/completions", body, timeout=20)

    held = [threading.Thread(target=ask, args=(f"held{i}", {"model": "scripted", "prompt": "hi", "seed": i}))
            for i in range(3)]
    try:
        for thread in held:
            thread.start()
        wait_for(lambda: "dew_requests_in_flight 3" in httpx.get(served.url + "/metrics").text)
        refused = post(served, "/v1/completions", {"model": "scripted", "prompt": "hi"})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.headers["retry-after"] == "1"
        refused = post(served, "/api/generate", {"model": "scripted", "prompt": "hi", "stream": False})
        assert refused.status_code == 429 and "full" in refused.json()["error"]
    finally:
        served.engine.allowance = None
        for thread in held:
            thread.join(20)
    assert [results[f"held{i}"].json()["choices"][0]["text"] for i in range(3)] == [SCRIPTS[i][:16] for i in range(3)]
    assert post(served, "/v1/completions", {"model": "scripted", "prompt": "hi"}).status_code == 200


def test_a_client_that_leaves_a_stream_or_a_whole_answer_frees_its_request(served):
    engine = served.engine
    engine.allowance = 1  # the stream starts with one token, then waits
    try:
        opened, closed = engine.opened, engine.closed
        with httpx.stream("POST", served.url + "/v1/completions", timeout=10,
                          json={"model": "scripted", "prompt": "hi", "stream": True, "max_tokens": 20}):
            wait_for(lambda: engine.opened == opened + 1)
        wait_for(lambda: engine.closed == closed + 1)  # the engine's iterator was closed: its row is free
        engine.allowance = 0
        with pytest.raises(httpx.ReadTimeout):
            post(served, "/api/generate", {"model": "scripted", "prompt": "hi", "stream": False}, timeout=0.5)
        wait_for(lambda: engine.closed == closed + 2)
        engine.allowance = 0  # a stream that leaves before its first token, too
        with pytest.raises(httpx.ReadTimeout):
            post(served, "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": "x"}],
                                                  "stream": True}, timeout=0.5)
        wait_for(lambda: engine.closed == closed + 3)
        wait_for(lambda: "dew_requests_in_flight 0" in httpx.get(served.url + "/metrics").text)
    finally:
        engine.allowance = None
    kept = post(served, "/v1/completions", {"model": "scripted", "prompt": "hi", "seed": 0, "max_tokens": 20})
    assert kept.json()["choices"][0]["text"] == SCRIPTS[0]  # and everyone else is still served
