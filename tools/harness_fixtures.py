"""Record what lm-eval's own HFLM computes over a tiny decoder, for tests/test_harness.py.

Writes tests/fixtures/harness/:

    model/            a tiny random Llama (vocab 512, context 64, tied head) saved with
                      save_pretrained, beside the tiny-tools tokenizer (no BOS; EOS <|endoftext|>)
    tokenizer-bos/    the same tokenizer with a post-processor that puts a BOS (<|im_start|>) first,
                      so HFLM's add-special-tokens and prefix-token paths are recorded too
    tokenizer-think/  the same tokenizer with a chat template that reads Qwen3's enable_thinking
                      control, for lm-eval's apply_chat_template path
    tasks/            two local lm-eval tasks: dew_tiny_mc (multiple choice over mc.jsonl) and
                      dew_tiny_perplexity (rolling loglikelihood over text.jsonl); their data_files
                      are relative, so lm-eval runs with tasks/ as the working directory
    expected.json     per tokenizer: loglikelihood requests with HFLM's (logprob, is_greedy),
                      loglikelihood_rolling requests with HFLM's sums, generate_until requests with
                      HFLM's strings; the two tasks' scores from simple_evaluate; and under
                      "chat", the prompts HFLM's apply_chat_template renders with and without
                      enable_thinking=False and the multiple-choice score with the template applied

Run with the reference environment (torch CPU, transformers, lm-eval 0.4.13):

    .venv-ref/bin/python tools/harness_fixtures.py
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import torch
import transformers
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/fixtures/harness"
TOKENIZER = ROOT / "tests/fixtures/tokenizers/tiny-tools"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
BATCH_SIZE = 4
WEIGHT_STD = 0.15  # wider than HF's 0.02 so the log-probabilities are far from uniform
SEED = 0

QUESTIONS = [
    ("What do bees make?", ["honey", "milk", "glass", "rain"], 0),
    ("Which season is the coldest?", ["summer", "winter", "spring"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("What colour is the sky on a clear day?", ["green", "blue"], 1),
    ("Where do fish live?", ["in trees", "in water", "in the desert"], 1),
    ("What is frozen water called?", ["steam", "sand", "ice"], 2),
]

DOCUMENTS = [
    "The river ran quietly past the old mill, where the wheel had not turned for many years. "
    "Children came in summer to throw stones into the water and to watch the ducks drift by.",
    "A tool is only as good as the hand that holds it. The carpenter checked every joint twice, "
    "sanded the edges smooth, and oiled the wood until it shone in the evening light.",
    "Short text.",
]

MC_TASK = """\
task: dew_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""

PERPLEXITY_TASK = """\
task: dew_tiny_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: text.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def build_model(directory: pathlib.Path) -> None:
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=64, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=0, pad_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.ndim == 1 and name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(WEIGHT_STD * torch.randn(tensor.shape, generator=generator))
    model.tie_weights()
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / name, directory / name)


def build_bos_tokenizer(directory: pathlib.Path) -> None:
    """The tiny-tools tokenizer with a BOS, as Llama-family tokenizers add one."""
    directory.mkdir(parents=True)
    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["bos_token"] = "<|im_start|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# Qwen3's generation prompt: enable_thinking=False writes an empty reasoning block the model skips.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

CHATS = [
    ([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What do bees make?"}], True),
    ([{"role": "user", "content": "What do bees make?"}, {"role": "assistant", "content": "They make"}], False),
]


def build_thinking_tokenizer(directory: pathlib.Path) -> None:
    directory.mkdir(parents=True)
    shutil.copyfile(TOKENIZER / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def record_chat(model: pathlib.Path, tokenizer: pathlib.Path) -> dict:
    """What HFLM's apply_chat_template renders, and the multiple-choice score through the template."""
    default = HFLM(pretrained=str(model), tokenizer=str(tokenizer), device="cpu", dtype="float32", batch_size=BATCH_SIZE)
    no_thinking = HFLM(pretrained=str(model), tokenizer=str(tokenizer), device="cpu", dtype="float32",
                       batch_size=BATCH_SIZE, enable_thinking=False)
    prompts = [{"history": history, "add_generation_prompt": opened,
                "default": default.apply_chat_template(history, opened),
                "enable_thinking_false": no_thinking.apply_chat_template(history, opened)} for history, opened in CHATS]
    assert prompts[0]["default"] != prompts[0]["enable_thinking_false"]
    return {"prompts": prompts, "scores": task_scores(no_thinking, ["dew_tiny_mc"], apply_chat_template=True)}


def write_tasks(directory: pathlib.Path) -> None:
    directory.mkdir(parents=True)
    with open(directory / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(directory / "text.jsonl", "w") as f:
        for text in DOCUMENTS:
            f.write(json.dumps({"text": text}) + "\n")
    (directory / "dew_tiny_mc.yaml").write_text(MC_TASK)
    (directory / "dew_tiny_perplexity.yaml").write_text(PERPLEXITY_TASK)


def instances(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def loglikelihood_requests(lm: HFLM) -> list[tuple[str, str]]:
    """The multiple-choice task's requests, and the edge cases of HFLM's tokenization."""
    pairs = [(f"Question: {q}\nAnswer:", f" {choice}") for q, choices, _ in QUESTIONS for choice in choices]
    long_context = " ".join(DOCUMENTS[:2])  # well past the 64-token context: left truncation
    prefix_text = lm.tokenizer.decode([lm.prefix_token_id])
    pairs += [
        ("", "Hello world"),                        # empty context: the prefix token conditions
        ("", f"{prefix_text}Hello world"),          # ... unless the continuation starts with it
        ("The cat sat on the ", "mat"),             # trailing spaces move to the continuation
        ("Tabs\t \n", "and newlines"),
        (long_context, " and the end."),
        (long_context, " " + " ".join(["word"] * 20)),  # a long continuation: truncation reaches far back
        (f"{prefix_text}Question: {QUESTIONS[0][0]}\nAnswer:", " honey"),  # text already holding the prefix
    ]
    # a continuation the model would produce greedily, so is_greedy is True at least once
    context = "The river ran"
    ids = lm.tok_encode(context)
    with torch.no_grad():
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=3, do_sample=False, pad_token_id=0)
    greedy = lm.tokenizer.decode(out[0, len(ids):].tolist())
    pairs.append((context, greedy))
    return pairs


def generate_requests(lm: HFLM) -> list[tuple[str, dict]]:
    """Greedy requests; most stop at a piece of the text the model writes when nothing stops it,
    so HFLM's stopping criteria cut them early."""
    contexts = ["The river ran", "Question: What do bees make?\nAnswer:", "A tool is", "Short", "Children came in summer"]
    free = lm.generate_until(instances("generate_until", [(c, {"until": ["never said"], "max_gen_toks": 12}) for c in contexts]),
                             disable_tqdm=True)
    requests = [(contexts[0], {"until": ["never said"], "max_gen_toks": 12, "do_sample": False})]
    for context, text in zip(contexts[1:], free[1:]):
        stop = text[4:6]
        requests.append((context, {"until": [stop, "zzzz"], "max_gen_toks": 12, "temperature": 0.0}))
    return requests


def record(lm: HFLM, with_generation: bool) -> dict:
    pairs = loglikelihood_requests(lm)
    scores = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    rolling = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(d,) for d in DOCUMENTS]), disable_tqdm=True)
    out = {
        "loglikelihood": [{"args": list(p), "logprob": float(s[0]), "is_greedy": bool(s[1])} for p, s in zip(pairs, scores)],
        "loglikelihood_rolling": [{"args": [d], "logprob": float(s)} for d, s in zip(DOCUMENTS, rolling)],
    }
    if with_generation:
        requests = generate_requests(lm)
        texts = lm.generate_until(instances("generate_until", requests), disable_tqdm=True)
        out["generate_until"] = [{"args": list(r), "text": t} for r, t in zip(requests, texts)]
    return out


def task_scores(lm: HFLM, tasks=("dew_tiny_mc", "dew_tiny_perplexity"), **options) -> dict:
    here = os.getcwd()
    os.chdir(OUT / "tasks")  # the task YAMLs name their data files relative to this directory
    try:
        results = simple_evaluate(model=lm, tasks=list(tasks),
                                  task_manager=TaskManager(include_path=str(OUT / "tasks")),
                                  batch_size=BATCH_SIZE, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  **options)
    finally:
        os.chdir(here)
    keep = ("acc,none", "acc_norm,none", "word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")
    return {task: {k: v for k, v in metrics.items() if k in keep} for task, metrics in results["results"].items()}


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    build_model(OUT / "model")
    build_bos_tokenizer(OUT / "tokenizer-bos")
    build_thinking_tokenizer(OUT / "tokenizer-think")
    write_tasks(OUT / "tasks")

    plain = HFLM(pretrained=str(OUT / "model"), device="cpu", dtype="float32", batch_size=BATCH_SIZE)
    with_bos = HFLM(pretrained=str(OUT / "model"), tokenizer=str(OUT / "tokenizer-bos"), device="cpu",
                    dtype="float32", batch_size=BATCH_SIZE)
    assert plain.prefix_token_id == 0 and with_bos.prefix_token_id == 1, (plain.prefix_token_id, with_bos.prefix_token_id)
    expected = {
        "batch_size": BATCH_SIZE,
        "max_length": plain.max_length,
        "plain": record(plain, with_generation=True),
        "bos": record(with_bos, with_generation=False),
        "scores": task_scores(plain),
        "chat": record_chat(OUT / "model", OUT / "tokenizer-think"),
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    greedy = [r["is_greedy"] for r in expected["plain"]["loglikelihood"]]
    print(f"{sum(greedy)} of {len(greedy)} loglikelihood requests greedy; scores {expected['scores']}")
    print("generated:", [r["text"] for r in expected["plain"]["generate_until"]])
    total = sum(path.stat().st_size for path in OUT.rglob("*") if path.is_file())
    print(f"total {total / 1024:.0f} KiB in {OUT}")


if __name__ == "__main__":
    main()
