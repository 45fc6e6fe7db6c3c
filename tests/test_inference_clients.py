"""OpenAICompletion and OllamaCompletion: how a Sampling becomes each backend's options, and what is
refused rather than dropped. Recording clients stand in for the SDKs here; tests/test_serve_clients.py
drives the real SDKs against `dew serve`."""

from types import SimpleNamespace

import pytest

from dew.inference import OllamaCompletion, OpenAICompletion
from dew.sampling import Sampling


class RecordingOpenAI:
    def __init__(self):
        self.calls = []
        self.completions = SimpleNamespace(create=self.create)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **request):
        self.calls.append(request)
        choice = SimpleNamespace(text="abc", message=SimpleNamespace(content="abc"), finish_reason="length")
        return SimpleNamespace(choices=[choice], usage=SimpleNamespace(prompt_tokens=4, completion_tokens=3))


class RecordingOllama:
    def __init__(self):
        self.calls = []

    def generate(self, **request):
        self.calls.append(request)
        return SimpleNamespace(response="xyz", done_reason="stop", prompt_eval_count=2, eval_count=5)


def test_a_provider_receives_every_sampling_control_and_a_generic_endpoint_refuses_them():
    client = RecordingOpenAI()
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, eos_token_ids=(7, 9))
    completion = OpenAICompletion("m", client, provider="sglang")(["a", "b"], 3, sampling=sampling, key=11, raw=True)
    request = client.calls[0]
    assert request["prompt"] == "a" and request["max_tokens"] == 3 and request["seed"] == 11
    assert (request["temperature"], request["top_p"]) == (0.7, 0.9)
    assert request["extra_body"] == {"top_k": 20, "min_p": 0.05, "stop_token_ids": [7, 9], "ignore_eos": True,
                                     "repetition_penalty": 1.0}
    assert completion.texts == ["abc", "abc"] and completion.token_counts == [3, 3]
    assert completion.usage == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14}
    OpenAICompletion("m", client)("a", 3, sampling=Sampling(temperature=0.5), key=1)  # raw=False: the chat endpoint
    assert client.calls[-1]["messages"] == [{"role": "user", "content": "a"}] and "extra_body" not in client.calls[-1]
    for setting in (dict(top_k=5), dict(min_p=0.1), dict(eos_token_ids=3)):
        with pytest.raises(ValueError, match=next(iter(setting))):
            OpenAICompletion("m", client)("a", 3, sampling=Sampling(**setting))
    with pytest.raises(ValueError, match="provider"):
        OpenAICompletion("m", client, provider="tgi")


def test_ollama_options_turn_off_the_daemons_penalties_and_refuse_token_ids():
    client = RecordingOllama()
    completion = OllamaCompletion("m", client)("a", 4, sampling=Sampling(temperature=0.0), key=3, raw=True)
    request = client.calls[0]
    assert request["raw"] and request["stream"] is False
    assert request["options"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0,
                                  "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                  "mirostat": 0, "num_predict": 4, "seed": 3}
    assert completion.texts == ["xyz"] and completion.finish_reasons == ["stop"] and completion.token_counts == [5]
    with pytest.raises(ValueError, match="token ids"):
        OllamaCompletion("m", client)("a", 4, sampling=Sampling(eos_token_ids=2))
    with pytest.raises(ValueError, match="max_new_tokens"):
        OllamaCompletion("m", client)("a", 0)
