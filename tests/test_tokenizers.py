"""Tokenizers: byte and BPE round trips, special ids, saving, and refusing to download."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dew.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY_TOOLS = ROOT / "tests/fixtures/tokenizers/tiny-tools"
TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "def f(x):\n    return x ** 2  # squares\r\n\n\tindented",
    "héllo wörld, naïve café — 日本語のテキスト, emoji 🎉🦀, Ωμέγα",
    "",
]


@pytest.fixture(scope="module")
def tiny():
    return HFTokenizer(TINY_TOOLS)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_utf8_text(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tokenizer.vocab_size == 256 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.asarray(ids, dtype=np.int32)) == text


def test_byte_tokenizer_uses_nul_as_eos_and_padding_and_drops_it_when_decoding():
    tokenizer = ByteTokenizer()
    assert tokenizer.eos_id == tokenizer.pad_id == 0 and tokenizer.bos_id is None
    ids = np.array(tokenizer.encode("ab") + [tokenizer.eos_id] + tokenizer.encode("ç") + [0, 0])
    assert tokenizer.decode(ids) == "abç"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tokenizer.decode([65, 300])
    with pytest.raises(ValueError, match="1-D"):
        tokenizer.decode(np.zeros((2, 3), np.int32))


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_tools_round_trips_text_including_non_ascii(tiny, text):
    ids = tiny.encode(text)
    assert all(0 <= i < tiny.vocab_size for i in ids)
    assert tiny.decode(ids) == text
    assert tiny.decode(np.asarray(ids, dtype=np.int64)) == text


def test_tiny_tools_is_a_512_token_bpe_that_merges_common_text(tiny):
    assert tiny.vocab_size == 512
    english = "The return statement leaves the current function call with the expression list."
    assert len(tiny.encode(english)) < 0.6 * len(english.encode())  # merges, not bytes


def test_tiny_tools_special_tokens_are_single_ids(tiny):
    eos = tiny.token_to_id("<|endoftext|>")
    assert tiny.eos_id == tiny.pad_id == eos and tiny.bos_id is None
    start, end = tiny.token_to_id("<|im_start|>"), tiny.token_to_id("<|im_end|>")
    assert len({eos, start, end}) == 3
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == start and ids[-2:] == [end, eos]
    # Padding (here the EOS) is dropped when decoding; the chat markers stay.
    assert tiny.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tiny.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_tiny_tools_config_declares_eos_pad_and_a_chatml_template_with_tools(tiny):
    config = json.loads((TINY_TOOLS / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    assert config["chat_template"] == (TINY_TOOLS / "chat_template.jinja").read_text()
    assert tiny.chat_template == config["chat_template"]
    for piece in ("<|im_start|>", "<|im_end|>", "tools", "tool_calls", "'tool'", "<tool_call>"):
        assert piece in tiny.chat_template
    assert sum(path.stat().st_size for path in TINY_TOOLS.iterdir()) < 100_000


def test_tiny_tools_chat_template_renders_tool_calls_in_chatml(tiny):
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tiny.chat_template)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    text = template.render(messages=messages, tools=tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n3<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.decode(tiny.encode(text)) == text


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the fixture was trained on 3.11's docs")
def test_the_tool_regenerates_the_committed_tiny_tools_files(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_tiny_tokenizer
    finally:
        sys.path.pop(0)
    train_tiny_tokenizer.write(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (TINY_TOOLS / name).read_bytes(), name


def test_hf_tokenizer_names_what_it_tried_for_a_source_it_cannot_find(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory, and not a Hub repository id") as error:
        HFTokenizer("gpt2")
    assert "'gpt2'" in str(error.value)
    with pytest.raises(FileNotFoundError, match="'acme/none' could not be read from the cache .*HF_HUB_OFFLINE"):
        HFTokenizer("acme/none")  # offline, and not in the test session's empty cache
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)  # a directory, but no tokenizer files in it


def test_load_tokenizer_takes_byte_or_a_directory_and_names_both_when_given_neither(tiny):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(TINY_TOOLS)), HFTokenizer)
    assert load_tokenizer(tiny) is tiny
    with pytest.raises(ValueError, match=r"'bytes'.*'byte', a local directory holding tokenizer.json, or a Hub"):
        load_tokenizer("bytes")
    with pytest.raises(FileNotFoundError, match="could not be read from the cache"):
        load_tokenizer("Qwen/Qwen3-0.6B")


def test_both_tokenizers_follow_the_protocol_and_describe_rebuilds_them(tiny):
    for tokenizer in (ByteTokenizer(), tiny):
        assert isinstance(tokenizer, Tokenizer)
        rebuilt = load_tokenizer(tokenizer.describe())
        assert type(rebuilt) is type(tokenizer)
        assert rebuilt.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    assert ByteTokenizer().describe() == "byte"
    assert tiny.describe() == str(TINY_TOOLS.resolve())


def test_save_writes_the_files_that_reload_the_same_tokenizer(tiny, tmp_path):
    tiny.save(tmp_path / "hf")
    names = sorted(path.name for path in (tmp_path / "hf").iterdir())
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    reloaded = load_tokenizer(tmp_path / "hf")
    assert reloaded.encode(TEXTS[1]) == tiny.encode(TEXTS[1])
    assert (reloaded.eos_id, reloaded.pad_id, reloaded.chat_template) == (
        tiny.eos_id,
        tiny.pad_id,
        tiny.chat_template,
    )
    ByteTokenizer().save(tmp_path / "byte")
    assert isinstance(load_tokenizer(tmp_path / "byte"), ByteTokenizer)


def test_hf_tokenizer_reads_added_token_dicts_and_named_templates(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((TINY_TOOLS / "tokenizer.json").read_bytes())
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": "<|im_start|>",
        "chat_template": [{"name": "default", "template": "{{ messages }}"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.eos_id == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.pad_id == tokenizer.eos_id  # no pad token: padding falls back to EOS
    assert tokenizer.bos_id == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.chat_template == "{{ messages }}"
    config["eos_token"] = "<|missing|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="<|missing|>"):
        HFTokenizer(tmp_path)
