"""`dew serve` as a subprocess over a tiny checkpoint directory, driven by the official `openai` and
`ollama` SDKs and by Dew's OpenAICompletion and OllamaCompletion: what the server draws is what the
task draws locally for the same prompt, sampling and seed.

Every prompt here (and the chat prompt the template renders) is 9 to 16 tokens long and every
request draws 6 tokens, greedy or at temperature 0.8, so the server and the local task each compile
only a few programs. The server runs three decode iterations per device call (`--decode-steps 3`), so
requests also end inside a call.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew.data import HFTokenizer
from dew.data.chat_messages import ChatTemplate
from dew.inference import OllamaCompletion, OpenAICompletion
from dew.interop import PretrainedDecoder
from dew.nn.backbones import CausalTransformer
from dew.sampling import Sampling

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

TINY_TOOLS = Path(__file__).parent / "fixtures" / "tokenizers" / "tiny-tools"
PROMPT, OTHER = "The trainer saves steps", "Sampling draws tokens"
BUDGET = 6
GREEDY = Sampling(temperature=0.0, eos_token_ids=(0,), pad_id=0)
SAMPLED = Sampling(temperature=0.8, eos_token_ids=(0,), pad_id=0)
CHAT = [{"role": "user", "content": "hi"}]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random decoder saved as a checkpoint directory with the tiny-tools tokenizer (and its
    chat template), served by `dew serve` in a subprocess; the local task over the same directory."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = HFTokenizer(TINY_TOOLS)
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, mlp_features=64, max_seq_len=64, dtype=jnp.float32, qk_norm=False,
                              tie_embeddings=False)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    PretrainedDecoder.from_model(model, {"params": variables["params"]}, tokenizer=tokenizer).save(root / "tiny")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dew.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    log = open(root / "serve.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "dew.cli.main", "serve", str(root / "tiny"), "--port", str(port),
                                "--name", "tiny", "--max-in-flight", "96", "--decode-steps", "3"],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"dew serve exited with {process.returncode}: {(root / 'serve.log').read_text()}")
            assert time.monotonic() < deadline, "dew serve did not come up in 180 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        task = dew.pipeline(root / "tiny")
        yield type("Served", (), dict(url=url, task=task, tokenizer=tokenizer, pid=process.pid))
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def local(served, ids, sampling, seed):
    """The text the task draws alone for prompt ids with `sampling` and `seed`, and its token count."""
    assert 9 <= len(ids) <= 16  # one prompt bucket for every request
    drawn = served.task([np.asarray(ids, np.int32)], BUDGET, seed=seed, sampling=sampling).host()
    return served.task.decode(drawn)[0], int(drawn.lengths[0])


def chat_ids(served):
    text = ChatTemplate(served.tokenizer.chat_template, served.tokenizer).render(CHAT, add_generation_prompt=True)
    return served.tokenizer.encode(text)


def openai_client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_completion_at_temperature_zero_returns_the_tokens_local_generation_draws(served):
    client = openai_client(served)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = OpenAICompletion("tiny", client)(PROMPT, BUDGET, sampling=Sampling(temperature=0.0), key=0, raw=True)
    text, length = local(served, served.tokenizer.encode(PROMPT), GREEDY, 0)
    assert completion.texts == [text] and completion.token_counts == [length]
    assert completion.finish_reasons == ["length" if length == BUDGET else "stop"]
    assert completion.usage["prompt_tokens"] == len(served.tokenizer.encode(PROMPT))
    assert completion.responses[0].model == "tiny"
    other, _ = local(served, served.tokenizer.encode(OTHER), GREEDY, 0)
    assert other != text  # the control: another prompt draws other tokens


def test_sampled_continuations_reproduce_by_seed_and_n_takes_the_next_seeds(served):
    client = openai_client(served)
    ids = served.tokenizer.encode(PROMPT)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=BUDGET, temperature=0.8, seed=3, n=2)
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=BUDGET, temperature=0.8, seed=3, n=2)
    texts = [choice.text for choice in first.choices]
    assert texts == [choice.text for choice in again.choices]
    assert texts == [local(served, ids, SAMPLED, 3)[0], local(served, ids, SAMPLED, 4)[0]]
    assert texts[0] != texts[1]
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=BUDGET, temperature=0.8, seed=3,
                                           n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == texts
    vllm_style = OpenAICompletion("tiny", client, provider="vllm")
    served_five = vllm_style(PROMPT, BUDGET, sampling=Sampling(temperature=0.8, eos_token_ids=(0,)), key=5, raw=True)
    assert served_five.texts == [local(served, ids, SAMPLED, 5)[0]]
    with pytest.raises(ValueError, match="top_k"):
        OpenAICompletion("tiny", client)(PROMPT, BUDGET, sampling=Sampling(top_k=5), key=0)


def test_chat_uses_the_checkpoints_template_plain_and_streamed(served):
    client = openai_client(served)
    text, length = local(served, chat_ids(served), GREEDY, 0)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=BUDGET, temperature=0,
                                           logprobs=True)
    assert reply.choices[0].message.content == text and reply.usage.completion_tokens == length
    assert len(reply.choices[0].logprobs.content) == length
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=BUDGET, temperature=0, stream=True) if chunk.choices)
    assert streamed == text


def test_ollama_sdk_generates_and_chats_and_ollama_completion_matches_local_greedy(served):
    client = ollama.Client(host=served.url, timeout=120)
    assert [m.model for m in client.list().models] == ["tiny"]
    text, length = local(served, served.tokenizer.encode(PROMPT), GREEDY, 0)
    options = {"temperature": 0, "num_predict": BUDGET}
    generated = client.generate(model="tiny", prompt=PROMPT, raw=True, options=options)
    assert generated.response == text and generated.done and generated.eval_count == length
    assert "".join(part.response for part in client.generate(model="tiny", prompt=PROMPT, raw=True, options=options,
                                                             stream=True)) == text
    chatted = client.chat(model="tiny", messages=CHAT, options=options)
    assert chatted.message.content == local(served, chat_ids(served), GREEDY, 0)[0]
    completion = OllamaCompletion("tiny", client)(PROMPT, BUDGET, sampling=Sampling(temperature=0.0), key=0, raw=True)
    assert completion.texts == [text] and completion.token_counts == [length]


def test_malformed_requests_get_their_4xx_while_a_valid_one_still_completes(served):
    client = openai_client(served)
    valid = {}

    def ask():
        valid["text"] = client.completions.create(model="tiny", prompt=OTHER, max_tokens=BUDGET, temperature=0,
                                                  stream=False).choices[0].text

    thread = threading.Thread(target=ask)
    thread.start()
    try:
        bad = [dict(model="nope"), dict(max_tokens=0), dict(n=0), dict(temperature=-1.0),
               dict(extra_body={"colour": "blue"}), dict(prompt="x " * 70)]
        for change in bad:
            request = dict(model="tiny", prompt=PROMPT, max_tokens=BUDGET) | change
            with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
                client.completions.create(**request)
            assert caught.value.status_code in (400, 404)
        with pytest.raises(ollama.ResponseError) as caught:
            ollama.Client(host=served.url).generate(model="tiny", prompt=PROMPT, options={"repeat_penalty": 1.3})
        assert caught.value.status_code == 400 and "repeat_penalty" in caught.value.error
    finally:
        thread.join(120)
    assert valid["text"] == local(served, served.tokenizer.encode(OTHER), GREEDY, 0)[0]


def test_a_json_schema_response_format_parses_and_validates_in_both_apis(served):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
              "required": ["ok", "colour"]}

    def valid(text):
        document = json.loads(text)
        return set(document) == {"ok", "colour"} and isinstance(document["ok"], bool) and document["colour"] in ("red", "green")

    client = openai_client(served)
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop" and valid(reply.choices[0].message.content)
    chatted = ollama.Client(host=served.url, timeout=120).chat(model="tiny", messages=CHAT, format=schema,
                                                               options={"temperature": 0, "num_predict": 40})
    assert valid(chatted.message.content)
    with pytest.raises(json.JSONDecodeError):  # the control: the same model unguided writes no JSON
        json.loads(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=BUDGET,
                                                  temperature=0).choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="schema"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/nowhere"}}})


def resident_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_under_load_every_valid_request_completes_right_and_every_malformed_one_gets_its_4xx(served):
    """64 concurrent clients for a minute, one request in ten malformed; prints the figures."""
    import asyncio
    import random

    cases = [(prompt, seed, sampling) for prompt in (PROMPT, OTHER) for seed in (0, 1) for sampling in (GREEDY, SAMPLED)]
    expected = {(p, s, x.temperature): local(served, served.tokenizer.encode(p), x, s)[0] for p, s, x in cases}
    bad = [{"model": "nope"}, {"max_tokens": 0}, {"n": 0}, {"temperature": -1}, {"colour": 1}, {"prompt": "x " * 70}]
    tally = {"valid": 0, "wrong": 0, "malformed": 0, "unexpected": 0}
    latencies = []

    async def client(number, until):
        pick = random.Random(number)
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            while time.monotonic() < until:
                if pick.random() < 0.1:
                    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": BUDGET} | pick.choice(bad)
                    response = await http.post("/v1/completions", json=body)
                    tally["malformed" if 400 <= response.status_code < 500 else "unexpected"] += 1
                    continue
                prompt, seed, sampling = pick.choice(cases)
                started = time.monotonic()
                response = await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": BUDGET, "seed": seed,
                    "temperature": sampling.temperature})
                latencies.append(time.monotonic() - started)
                if response.status_code != 200:
                    tally["unexpected"] += 1
                elif response.json()["choices"][0]["text"] == expected[(prompt, seed, sampling.temperature)]:
                    tally["valid"] += 1
                else:
                    tally["wrong"] += 1

    async def load(seconds):
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(i, until) for i in range(64)))

    asyncio.run(load(5))  # warm up
    before = resident_mib(served.pid)
    tally.update(valid=0, wrong=0, malformed=0, unexpected=0)
    latencies.clear()
    asyncio.run(load(60))
    after = resident_mib(served.pid)
    latencies.sort()
    print(f"under load: {tally}, p50 {latencies[len(latencies) // 2]:.3f} s, p99 "
          f"{latencies[int(len(latencies) * 0.99)]:.3f} s, resident {before:.0f} -> {after:.0f} MiB")
    assert tally["wrong"] == tally["unexpected"] == 0 and tally["valid"] > 0 and tally["malformed"] > 0
    assert httpx.get(served.url + "/health").status_code == 200
    assert after < before * 1.1 + 50
