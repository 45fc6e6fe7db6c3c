"""Regenerate tests/fixtures/tokenizers/tiny-tools: a 512-token byte-level BPE tokenizer.

The training text is Python's own documentation topics (`pydoc_data.topics`, shipped with every
CPython), read in sorted key order, so the result depends only on the Python minor version and the
`tokenizers` version. The committed files came from Python 3.11 and tokenizers 0.23.3.

    python tools/train_tiny_tokenizer.py [--out tests/fixtures/tokenizers/tiny-tools]

The tokenizer is GPT-2-shaped (byte-level pre-tokenizer with GPT-2's split pattern, byte-level
decoder), with `<|endoftext|>` as end-of-text and padding token and ChatML turn markers
`<|im_start|>`/`<|im_end|>`. Its chat template renders system, user, assistant and tool turns,
tool schemas and tool calls in ChatML, the way Qwen's templates do.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

VOCAB_SIZE = 512
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]

# ChatML. Tools (JSON schemas) go in the system turn inside <tools></tools>; an assistant's tool
# calls are JSON objects inside <tool_call></tool_call>; tool results come back in a user turn
# inside <tool_response></tool_response>, consecutive results sharing one turn.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nThese functions are available. Their signatures follow inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role in ['system', 'user', 'assistant'] %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def training_text() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def build():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    return tokenizer


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=Path, default=root / "tests/fixtures/tokenizers/tiny-tools")
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread: no ordering left to chance
    write(args.out)
    sizes = {path.name: path.stat().st_size for path in sorted(args.out.iterdir())}
    print(f"wrote {args.out}: {sizes}")


if __name__ == "__main__":
    main()
