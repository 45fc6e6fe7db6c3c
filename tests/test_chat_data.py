"""ChatMessages: chat-template rendering with per-token roles, tools, file layouts, and the SFT mask."""

import json

import jax
import numpy as np
import pytest

from dew.data import ByteTokenizer, ChatMessages, HFTokenizer, Partition
from dew.data.chat import Role
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective

TOOLS = "tests/fixtures/tokenizers/tiny-tools"

TOOL_CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "Sunny, 20C."},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
}
SIMPLE = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return HFTokenizer(TOOLS)


def text_of(tokenizer, ids, roles, role):
    return tokenizer.decode([int(i) for i, r in zip(ids, roles) if r == role])


def test_roles_follow_the_template_with_tool_calls_responses_and_schemas(tokenizer):
    chat = ChatMessages([TOOL_CHAT], tokenizer, seq_len=512)
    ids, roles = chat.render(TOOL_CHAT)
    full = tokenizer.decode(ids)
    assert full == chat.template.render(TOOL_CHAT["messages"], TOOL_CHAT["tools"])
    system = text_of(tokenizer, ids, roles, Role.SYSTEM)
    assert "Be brief." in system and '"name": "weather"' in system  # the tool schema is system text
    assistant = text_of(tokenizer, ids, roles, Role.ASSISTANT)
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in assistant
    assert assistant.endswith("Sunny, 20C.<|im_end|>\n")
    assert "<|im_start|>" not in assistant  # the generation header is template glue
    tool = text_of(tokenizer, ids, roles, Role.TOOL)
    assert "<tool_response>\nsunny\n</tool_response>" in tool and "20C" in tool
    assert "Weather in Paris?" in text_of(tokenizer, ids, roles, Role.USER)
    assert text_of(tokenizer, ids, roles, Role.NONE) == "<|im_start|>assistant\n" * 2


def test_rows_are_padded_or_truncated_to_seq_len_plus_one(tokenizer):
    data = ChatMessages([SIMPLE, TOOL_CHAT], tokenizer, seq_len=40)
    columns = data.columns()
    assert columns["text"].shape == columns["text_roles"].shape == (2, 41)
    assert columns["text"].dtype == np.int32 and columns["text_roles"].dtype == np.int8
    ids, roles = data.render(SIMPLE)
    n = len(ids)
    np.testing.assert_array_equal(columns["text"][0, :n], ids)
    np.testing.assert_array_equal(columns["text"][0, n:], tokenizer.pad_id)
    np.testing.assert_array_equal(columns["text_roles"][0, n:], Role.NONE)
    np.testing.assert_array_equal(columns["mask"][0], [1] * n + [0] * (41 - n))
    long_ids, _ = data.render(TOOL_CHAT)
    np.testing.assert_array_equal(columns["text"][1], long_ids[:41])
    batch = next(iter(data.load(batch=2).train(Partition())))
    assert batch["text"].shape == (2, 41)


def test_reads_jsonl_files_and_hub_layout_directories(tokenizer, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [SIMPLE, TOOL_CHAT, SIMPLE]) + "\n")
    assert len(ChatMessages(path, tokenizer, seq_len=64)) == 3
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "data" / "train-00000.jsonl").write_text(json.dumps(SIMPLE) + "\n")
    (hub / "data" / "test-00000.jsonl").write_text(json.dumps(TOOL_CHAT) + "\n")
    data = ChatMessages(hub, tokenizer, seq_len=64)
    assert len(data) == 1  # the train split only


def test_parquet_files_read_like_jsonl(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.Table.from_pylist([SIMPLE, {"messages": TOOL_CHAT["messages"][:2] + [{"role": "assistant", "content": "Sunny."}]}])
    pq.write_table(table, tmp_path / "chats.parquet")
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in table.to_pylist()) + "\n")
    from_parquet = ChatMessages(tmp_path / "chats.parquet", tokenizer, seq_len=64)
    from_jsonl = ChatMessages(tmp_path / "chats.jsonl", tokenizer, seq_len=64)
    for name in ("text", "text_roles"):
        np.testing.assert_array_equal(from_parquet.columns()[name], from_jsonl.columns()[name])
    assert (from_parquet.columns()["text_roles"] == Role.ASSISTANT).any()


def test_parquet_without_pyarrow_names_the_package(tokenizer, tmp_path):
    pytest.importorskip("jinja2")
    try:
        import pyarrow  # noqa: F401
        pytest.skip("pyarrow is installed")
    except ImportError:
        pass
    path = tmp_path / "chats.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pyarrow"):
        ChatMessages(path, tokenizer, seq_len=16).columns()


def test_bad_conversations_fail_with_clear_errors(tokenizer):
    odd = {"messages": [{"role": "narrator", "content": "Once"}]}
    with pytest.raises(ValueError, match="record 0, message 0 has role 'narrator'"):
        ChatMessages([odd], tokenizer, seq_len=16).columns()
    # A role Dew knows but the template refuses: the template's own message, with the record.
    strict = "{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('Unknown message role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="record 1: Unknown message role: tool"):
        ChatMessages([SIMPLE | {"messages": SIMPLE["messages"][:1]}, {"messages": [{"role": "tool", "content": "x"}]}],
                     tokenizer, seq_len=16, chat_template=strict).columns()
    with pytest.raises(ValueError, match="needs a non-empty 'messages'"):
        ChatMessages([{"text": "hi"}], tokenizer, seq_len=16).columns()
    with pytest.raises(ValueError, match="no chat template"):
        ChatMessages([SIMPLE], ByteTokenizer(), seq_len=16)


def test_byte_tokens_with_a_template_get_exact_roles():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    data = ChatMessages([SIMPLE], ByteTokenizer(), seq_len=40, chat_template=template)
    ids, roles = data.render(SIMPLE)
    assert bytes(ids).decode() == "<user>Hi there\n<assistant>Hello!\n"
    assert bytes(i for i, r in zip(ids, roles) if r == Role.ASSISTANT).decode() == "<assistant>Hello!\n"


def test_template_controls_pass_through_and_unknown_ones_are_refused():
    """A control the template reads (Qwen3's enable_thinking here) changes the rendering and the
    roles follow it; a name the template never reads is refused when the dataset is built."""
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and enable_thinking is defined "
                "and not enable_thinking %}<think></think>{% endif %}{{ m.content }}\n{% endfor %}")
    plain = ChatMessages([SIMPLE], ByteTokenizer(), seq_len=60, chat_template=template)
    quiet = ChatMessages([SIMPLE], ByteTokenizer(), seq_len=60, chat_template=template,
                         chat_template_kwargs={"enable_thinking": False})
    assert bytes(plain.render(SIMPLE)[0]).decode() == "<user>Hi there\n<assistant>Hello!\n"
    ids, roles = quiet.render(SIMPLE)
    assert bytes(ids).decode() == "<user>Hi there\n<assistant><think></think>Hello!\n"
    assert bytes(i for i, r in zip(ids, roles) if r == Role.ASSISTANT).decode() == "<assistant><think></think>Hello!\n"
    with pytest.raises(ValueError, match="reads no thinking_budget; the controls it reads are: enable_thinking"):
        ChatMessages([SIMPLE], ByteTokenizer(), seq_len=60, chat_template=template,
                     chat_template_kwargs={"thinking_budget": 3})

    from dew.data.prompts import Prompts

    class Templated(ByteTokenizer):
        chat_template = template + ("{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                                    "not enable_thinking %}<think></think>{% endif %}{% endif %}")

    quiet_prompts = Prompts([{"prompt": [{"role": "user", "content": "Hi"}]}], 40, tokenizer=Templated(),
                            chat_template_kwargs={"enable_thinking": False})
    row = quiet_prompts.columns()
    assert bytes(row["prompt"][0, : row["prompt_length"][0]].tolist()).decode() == "<user>Hi\n<assistant><think></think>"


def test_sft_loss_counts_only_assistant_targets(tokenizer):
    data = ChatMessages([SIMPLE, TOOL_CHAT], tokenizer, seq_len=420)
    batch = dict(data.columns())
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=32, num_layers=1, num_heads=2,
                              mlp_features=64, max_seq_len=420)
    objective = LMObjective(model, seq_len=420, loss_role=Role.ASSISTANT)
    objective.check(batch)
    variables = objective.init(jax.random.key(0))
    losses, mask = jax.jit(objective.token_losses)(variables, batch)
    expected = (batch["text_roles"][:, 1:] == Role.ASSISTANT)
    np.testing.assert_array_equal(np.asarray(mask) > 0, expected)
    # the targets that count are exactly the assistant replies (and their end tokens)
    counted = [tokenizer.decode(row[1:][m]) for row, m in zip(batch["text"], expected)]
    assert counted[0] == "Hello!<|im_end|>\n"
    assert "Weather" not in counted[1] and "sunny" not in counted[1] and "Sunny, 20C." in counted[1]
    loss, aux = jax.jit(objective.loss)(variables, batch, Step(0, jax.random.key(1)))
    assert float(aux.metrics["tokens"]) == expected.sum()
    assert float(loss) == pytest.approx(float(np.asarray(losses)[expected].mean()), rel=1e-5)


def test_a_directory_without_data_files_is_refused(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="no data/\\*.jsonl"):
        ChatMessages(tmp_path, tokenizer, 8).columns()
