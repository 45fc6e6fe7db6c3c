"""DewLM against lm-eval's own HFLM on the same weights.

tests/fixtures/harness/expected.json holds what HFLM computed (tools/harness_fixtures.py) over a
tiny Llama with the tiny-tools tokenizer, and with a variant of it that adds a BOS: per-request
loglikelihoods, rolling loglikelihoods, generations, and two local tasks' scores. DewLM reads the
same checkpoint directory through dew.pipeline and must give the same numbers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import ByteTokenizer, HFTokenizer
from dew.eval import harness
from dew.eval.harness import DewLM, cut_at, rolling_windows
from dew.inference.text import TextGeneration
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.sampling.text import Sampling

FIXTURE = Path("tests/fixtures/harness")
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
TOLERANCE = 1e-4


def requests(records):
    return [SimpleNamespace(args=tuple(record["args"])) for record in records]


@pytest.fixture(scope="module")
def lm():
    return DewLM(FIXTURE / "model", batch_size=EXPECTED["batch_size"])


@pytest.fixture(scope="module")
def lm_with_bos(lm):
    return DewLM(lm.task, batch_size=EXPECTED["batch_size"], tokenizer=HFTokenizer(FIXTURE / "tokenizer-bos"))


def mismatches(lm, variant):
    """The loglikelihood and rolling requests where `lm` differs from HFLM."""
    expected = EXPECTED[variant]
    wrong = []
    for record, (logprob, greedy) in zip(expected["loglikelihood"], lm.loglikelihood(requests(expected["loglikelihood"]))):
        if abs(logprob - record["logprob"]) > TOLERANCE or greedy != record["is_greedy"]:
            wrong.append(tuple(record["args"]))
    rolling = expected["loglikelihood_rolling"]
    for record, logprob in zip(rolling, lm.loglikelihood_rolling(requests(rolling))):
        if abs(logprob - record["logprob"]) > TOLERANCE:
            wrong.append(tuple(record["args"]))
    return wrong


def test_loglikelihoods_and_rolling_windows_match_hflm(lm, lm_with_bos):
    assert lm.max_length == EXPECTED["max_length"] and lm.prefix_token_id == 0 and lm_with_bos.prefix_token_id == 1
    assert mismatches(lm, "plain") == []
    assert mismatches(lm_with_bos, "bos") == []
    assert any(r["is_greedy"] for r in EXPECTED["plain"]["loglikelihood"])  # both answers are exercised
    compiled = harness._score_jit._cache_size()
    assert compiled <= 4  # one compilation per padded width (8, 16, 32, 64)
    lm.loglikelihood(requests(EXPECTED["bos"]["loglikelihood"]))
    assert harness._score_jit._cache_size() == compiled


def test_multiple_choice_accuracy_from_dew_matches_hflms_task_score(lm):
    """acc of the local multiple-choice task: the choice with the highest loglikelihood, per question."""
    docs = [json.loads(line) for line in (FIXTURE / "tasks/mc.jsonl").read_text().splitlines()]
    pairs = [(f"Question: {d['question']}\nAnswer:", f" {c}") for d in docs for c in d["choices"]]
    scores = iter(lm.loglikelihood([SimpleNamespace(args=p) for p in pairs]))
    correct = [int(np.argmax([next(scores)[0] for _ in d["choices"]]) == d["answer"]) for d in docs]
    assert np.mean(correct) == pytest.approx(EXPECTED["scores"]["dew_tiny_mc"]["acc,none"])


def test_generate_until_matches_hflm_and_stops_at_the_until_strings(lm):
    records = EXPECTED["plain"]["generate_until"]
    texts = lm.generate_until([SimpleNamespace(args=(r["args"][0], r["args"][1])) for r in records])
    assert texts == [r["text"] for r in records]
    assert any(len(r["text"]) < 8 for r in records)  # the stop strings cut some of them short


@pytest.mark.parametrize("fault", ["no space move", "prefix token", "one position off", "short window"])
def test_negative_controls_each_break_the_match(lm, lm_with_bos, monkeypatch, fault):
    """Each plausible mistake changes some number past the tolerance."""
    if fault == "no space move":
        real = lm.encode_pair

        def encode_pair(context, continuation):
            if not context:
                return real(context, continuation)
            ids = lm.tok_encode(context)
            return ids, lm.tok_encode(context + continuation)[len(ids):]
        monkeypatch.setattr(lm, "encode_pair", encode_pair)
        assert ("The cat sat on the ", "mat") in mismatches(lm, "plain")
    elif fault == "prefix token":  # EOS where HFLM conditions an empty context on the BOS
        eos_prefixed = DewLM(lm.task, batch_size=4, tokenizer=lm_with_bos.tokenizer, prefix_token_id=0)
        assert ("", "Hello world") in mismatches(eos_prefixed, "bos")
    elif fault == "one position off":
        real = harness._score_function(lm.task.model)
        late = lambda a: jnp.pad(a[:, :-1], ((0, 0), (1, 0)))  # noqa: E731  (each score read one position late)
        monkeypatch.setattr(lm, "_score", lambda v, x, y: tuple(late(a) for a in real(v, x, y)))
        assert len(mismatches(lm, "plain")) == len(EXPECTED["plain"]["loglikelihood"]) + len(EXPECTED["plain"]["loglikelihood_rolling"])
    else:  # a shorter window than HFLM's: truncation and rolling windows differ
        short = DewLM(lm.task, batch_size=4, max_length=62)  # the longest continuation is 60 tokens
        wrong = mismatches(short, "plain")
        assert any(len(args) == 1 for args in wrong) and any(len(args) == 2 for args in wrong)


def test_rolling_windows_are_lm_evals_example():
    """The example in lm-eval's LM.loglikelihood_rolling docstring: ten tokens, a window of four."""
    windows = rolling_windows(list(range(10)), prefix_token=-1, max_length=4)
    inputs = [(context + continuation)[:-1] for context, continuation in windows]
    assert inputs == [[-1, 0, 1, 2], [3, 4, 5, 6], [5, 6, 7, 8]]
    assert [continuation for _, continuation in windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert rolling_windows([], 0, 4) == []
    assert cut_at("one. two\nthree", ["\n", "."]) == "one" and cut_at("abc", ["", "zz"]) == "abc"


@pytest.fixture(scope="module")
def byte_task():
    model = CausalTransformer(vocab_size=256, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, max_seq_len=16)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return TextGeneration(model, variables, processor=ByteTokenizer())


def test_a_byte_level_task_scores_what_its_logits_say(byte_task):
    """A Dew task with a ByteTokenizer (no special tokens): an empty context is conditioned on EOS,
    and the score is the sum of the continuation's log-softmax read one position back."""
    model, variables = byte_task.model, byte_task.variables
    lm = DewLM(byte_task, batch_size=2)
    [(empty, _), (plain, _)] = lm.loglikelihood([SimpleNamespace(args=("", "hi")), SimpleNamespace(args=("a b ", "c"))])

    def direct(tokens, scored):
        logprobs = jax.nn.log_softmax(jax.jit(model.apply)(variables, jnp.asarray([tokens[:-1]])), axis=-1)[0]
        return float(sum(logprobs[i - 1, tokens[i]] for i in range(len(tokens) - scored, len(tokens))))

    assert empty == pytest.approx(direct([0, ord("h"), ord("i")], 2), abs=1e-5)
    assert plain == pytest.approx(direct(list(b"a b c"), 2), abs=1e-5)  # " c": the trailing space moved


def test_greedy_generation_is_the_tasks_and_sampling_follows_the_seed(byte_task):
    lm = DewLM(byte_task, batch_size=2)
    [greedy] = lm.generate_until([SimpleNamespace(args=("ab", {"until": ["never"], "max_gen_toks": 4}))])
    drawn = byte_task([list(b"ab")] * 2, 4, seed=0, sampling=Sampling(temperature=0.0, eos_token_ids=(0,))).host()
    assert greedy == ByteTokenizer().decode(drawn.tokens[0, : drawn.lengths[0]])
    sampled = [SimpleNamespace(args=("ab", {"max_gen_toks": 4, "do_sample": True, "temperature": 1.0}))] * 2
    assert lm.generate_until(sampled) == DewLM(byte_task, batch_size=2).generate_until(sampled)
    assert DewLM(byte_task, batch_size=2, seed=1).generate_until(sampled) != lm.generate_until(sampled)


def test_bad_input_fails_early_with_what_to_do(lm):
    model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16)
    bare = TextGeneration(model, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))
    with pytest.raises(ValueError, match="has no tokenizer; pass tokenizer="):
        DewLM(bare)
    with pytest.raises(ValueError, match="longer than the model's max_seq_len=64"):
        DewLM(lm.task, max_length=65)
    with pytest.raises(ValueError, match="configure dew.pipeline"):
        DewLM(lm.task, step=3)
    with pytest.raises(TypeError, match="got int"):
        DewLM(3)
    with pytest.raises(ValueError, match="max_gen_toks=64 leaves no room"):
        lm.generate_until([SimpleNamespace(args=("a", {"until": ["."], "max_gen_toks": 8})),
                           SimpleNamespace(args=("a", {"until": ["."], "max_gen_toks": 64}))])
    with pytest.raises(ValueError, match=r"\['num_beams'\] are not supported"):
        lm.generate_until([SimpleNamespace(args=("a", {"until": ["."], "num_beams": 4}))])
    with pytest.raises(ValueError, match="fixed batch_size"):
        DewLM.create_from_arg_obj({"source": str(FIXTURE / "model")}, {"batch_size": "auto"})
    with pytest.raises(ValueError, match="drop device="):
        DewLM.create_from_arg_obj({"source": str(FIXTURE / "model")}, {"device": "cuda"})
    assert lm.token_text(lm.eot_token_id) == "<|endoftext|>"  # the pad id too, which decode drops
    with pytest.raises(ValueError, match="args are a tuple of 2"):
        lm.loglikelihood([SimpleNamespace(args=("only context",))])


def test_chat_prompts_are_hflms_with_the_templates_own_controls(lm):
    """apply_chat_template renders what HFLM's renders over a template that reads Qwen3's
    enable_thinking: a generation prompt, a continued last message, and the control passed through."""
    tokenizer = HFTokenizer(FIXTURE / "tokenizer-think")
    default = DewLM(lm.task, batch_size=EXPECTED["batch_size"], tokenizer=tokenizer)
    no_thinking = DewLM(lm.task, batch_size=EXPECTED["batch_size"], tokenizer=tokenizer, enable_thinking=False)
    for record in EXPECTED["chat"]["prompts"]:
        assert default.apply_chat_template(record["history"], record["add_generation_prompt"]) == record["default"]
        assert (no_thinking.apply_chat_template(record["history"], record["add_generation_prompt"])
                == record["enable_thinking_false"])
    assert no_thinking.chat_template(True) == tokenizer.chat_template and no_thinking.chat_template(False) is None
    assert default.tokenizer_name == str(tokenizer.directory).replace("/", "__")

    with pytest.raises(ValueError, match="reads no reasoning_effort; the controls it reads are: enable_thinking"):
        DewLM(lm.task, tokenizer=tokenizer, chat_template_args={"reasoning_effort": "low"})
    with pytest.raises(ValueError, match="needs think_end_token="):
        DewLM(lm.task, tokenizer=tokenizer, enable_thinking=True)
    with pytest.raises(ValueError, match="this tokenizer has none"):
        DewLM(lm.task, tokenizer=HFTokenizer(FIXTURE / "tokenizer-bos"), enable_thinking=False)


def test_a_reasoning_section_is_cut_from_generations_at_its_last_end(lm):
    """With think_end_token, a generation keeps what follows the reasoning's last end (text or id)."""
    tokenizer = HFTokenizer(FIXTURE / "tokenizer-think")
    by_text = DewLM(lm.task, tokenizer=tokenizer, think_end_token="</think>")
    assert by_text._answer(tokenizer.encode("let me see</think> a</think>  the answer")) == "the answer"
    assert by_text._answer(tokenizer.encode("no reasoning here")) == "no reasoning here"
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1
    by_id = DewLM(lm.task, tokenizer=tokenizer, think_end_token=str(im_end[0]))  # lm-eval's args are strings
    tokens = tokenizer.encode("thinking") + im_end + tokenizer.encode("  done")
    assert by_id.think_end_token == im_end[0] and by_id._answer(tokens) == "done"
    assert DewLM(lm.task, tokenizer=tokenizer)._answer(tokens).endswith("  done")  # no cut without one


def test_the_module_imports_without_lm_eval():
    if importlib.util.find_spec("lm_eval") is None:
        assert DewLM.__bases__ == (object,)
    else:
        from lm_eval.api.model import LM

        assert issubclass(DewLM, LM)


@pytest.mark.reference
def test_simple_evaluate_over_dewlm_gives_hflms_task_scores(monkeypatch):
    """lm-eval's own evaluator, over the local multiple-choice and perplexity tasks: DewLM's scores
    are HFLM's, live on the same weights and as recorded."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = (FIXTURE / "tasks").resolve()
    model = (FIXTURE / "model").resolve()
    monkeypatch.chdir(tasks)  # the task YAMLs name their data files relative to their directory
    names = ["dew_tiny_mc", "dew_tiny_perplexity"]

    def scores(lm):
        results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=str(tasks)),
                                          random_seed=0, numpy_random_seed=0, torch_random_seed=0)
        return {task: {k: v for k, v in results["results"][task].items() if k in EXPECTED["scores"][task]} for task in names}

    dew_scores = scores(DewLM(model, batch_size=EXPECTED["batch_size"]))
    by_name = lm_eval.simple_evaluate(model="dew", model_args=f"source={model},batch_size=4", tasks=names[:1],
                                      task_manager=TaskManager(include_path=str(tasks)))  # registered as "dew"
    assert by_name["results"]["dew_tiny_mc"]["acc,none"] == pytest.approx(EXPECTED["scores"]["dew_tiny_mc"]["acc,none"])
    hf_scores = scores(HFLM(pretrained=str(model), device="cpu", dtype="float32", batch_size=EXPECTED["batch_size"]))
    for reference in (hf_scores, EXPECTED["scores"]):
        assert dew_scores.keys() == reference.keys()
        for task in names:
            assert dew_scores[task].keys() == reference[task].keys()
            for metric, value in reference[task].items():
                assert dew_scores[task][metric] == pytest.approx(value, rel=1e-4), (task, metric)


@pytest.mark.reference
def test_simple_evaluate_with_the_chat_template_gives_hflms_score(monkeypatch):
    """lm-eval's evaluator applying the chat template (enable_thinking=False): DewLM's multiple-choice
    scores are HFLM's, live and as recorded."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = (FIXTURE / "tasks").resolve()
    model, tokenizer = (FIXTURE / "model").resolve(), (FIXTURE / "tokenizer-think").resolve()
    monkeypatch.chdir(tasks)

    def scores(lm):
        results = lm_eval.simple_evaluate(model=lm, tasks=["dew_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)),
                                          apply_chat_template=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
        return {k: v for k, v in results["results"]["dew_tiny_mc"].items() if k in EXPECTED["chat"]["scores"]["dew_tiny_mc"]}

    dew = scores(DewLM(model, batch_size=EXPECTED["batch_size"], tokenizer=HFTokenizer(tokenizer), enable_thinking=False))
    hf = scores(HFLM(pretrained=str(model), tokenizer=str(tokenizer), device="cpu", dtype="float32",
                     batch_size=EXPECTED["batch_size"], enable_thinking=False))
    for reference in (hf, EXPECTED["chat"]["scores"]["dew_tiny_mc"]):
        assert dew.keys() == reference.keys()
        for metric, value in reference.items():
            assert dew[metric] == pytest.approx(value, rel=1e-4), metric


def test_a_saved_run_scores_as_its_own_task(tmp_path):
    """A run directory goes through dew.pipeline, with the run's tokenizer (its EMA weights by default)."""
    from dew import Checkpoints, Dataset, Trainer
    from dew.config import ModelConfig, ObjectiveConfig, OptimConfig, RunConfig
    from dew.objectives.lm import LMObjective

    tokenizer = ByteTokenizer()
    model = CausalTransformer(vocab_size=256, emb_features=32, num_layers=1, num_heads=2, mlp_features=64, max_seq_len=16)
    objective = LMObjective(model, seq_len=8, ema_decay=0.5, tokenizer=tokenizer)
    batch = {"text": np.tile(np.frombuffer(b"abcabcabc", np.uint8).astype(np.int32), (8, 1))}
    optim = OptimConfig(optimizer="adam", learning_rate=1e-2)
    checkpoints = Checkpoints(tmp_path / "run")
    state = Trainer(objective, optim.build(), key=jax.random.key(0), checkpoints=checkpoints).fit(
        Dataset.from_records(batch, batch=8), steps=1, log_every=1, checkpoint_every=1)
    checkpoints.wait()
    RunConfig(model=ModelConfig.from_model(model), optim=optim, objective=ObjectiveConfig.from_objective(objective)).save(
        tmp_path / "run", tokenizer=tokenizer)

    request = [SimpleNamespace(args=("ab", "ca"))]
    from_run = DewLM(tmp_path / "run", batch_size=2)
    assert from_run.loglikelihood(request) == DewLM(objective.pipeline(state), batch_size=2, tokenizer=tokenizer).loglikelihood(request)
    assert from_run.loglikelihood(request) != DewLM(tmp_path / "run", batch_size=2, ema=False).loglikelihood(request)
