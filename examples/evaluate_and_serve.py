"""Score finished runs and compare each decoder served over HTTP with the same decoder run locally.

For a decoder run it reports
- the perplexity of held-out text (rolling log-likelihoods over the model's context, as lm-eval's
  perplexity tasks compute them, through `dew.eval.harness.DewLM`);
- an lm-eval-harness suite over local task files (`--tasks DIR NAME...`), when lm-eval is installed
  (`pip install 'dewml[eval-harness]'`; otherwise the report says it was skipped and why);
- the served-model comparison: `dew serve RUN` on a loopback port, asked through the official
  `openai` SDK (`OpenAICompletion`) at temperature 0, against the run's own task drawing locally.
For a diffusion run it reports image metrics: a Fréchet distance between drawn samples and the
run's own training images, in the features of a fixed random conv net (a cheap, download-free
stand-in for Inception, comparable between runs of one dataset, not with published FIDs).
Everything lands in one JSON report.

    python examples/evaluate_and_serve.py runs/lm --text held_out.txt --report report.json
    python examples/evaluate_and_serve.py runs/digits --report report.json
    python examples/evaluate_and_serve.py --smoke     # trains two tiny runs offline, then scores them
                                                      # (the lm-eval suite: two small local tasks)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:", "To be, or not", "The "]


def score_decoder(run: Path, task, ema: bool, text: str, tasks: tuple[Path, list[str]] | None, new_tokens: int) -> dict:
    from dew.eval.harness import DewLM

    scorer = DewLM(task, batch_size=4)
    request = type("Request", (), {"args": (text,)})()
    total = scorer.loglikelihood_rolling([request])[0]
    tokens = len(task.processor.tokenizer.encode(text))
    report = {"kind": "decoder", "held_out_tokens": tokens, "perplexity": math.exp(-total / tokens)}
    report["lm_eval"] = lm_eval_suite(scorer, tasks)
    report["served"] = served_comparison(run, task, ema, new_tokens)
    return report


def lm_eval_suite(scorer, tasks: tuple[Path, list[str]] | None) -> dict:
    if tasks is None:
        return {"skipped": "no --tasks given"}
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        return {"skipped": "lm-eval is not installed: pip install 'dewml[eval-harness]'"}
    directory, names = tasks
    here = os.getcwd()
    os.chdir(directory)  # local task files name their data relative to their folder
    try:
        results = lm_eval.simple_evaluate(model=scorer, tasks=names, task_manager=TaskManager(include_path=str(directory)))
    finally:
        os.chdir(here)
    return {name: {k: v for k, v in scores.items() if isinstance(v, (int, float))} for name, scores in results["results"].items()}


def served_comparison(run: Path, task, ema: bool, new_tokens: int) -> dict:
    """`dew serve RUN` on a free loopback port, asked at temperature 0 through the openai SDK."""
    import httpx
    import openai

    from dew.inference import OpenAICompletion
    from dew.sampling import Sampling

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen([sys.executable, "-m", "dew.cli.main", "serve", str(run), "--port", str(port), "--name", "run",
                               *([] if ema else ["--live"])],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"dew serve exited with status {server.returncode}:\n{log.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("dew serve did not answer /health within 300 s")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        greedy = Sampling(temperature=0.0)
        began = time.perf_counter()
        served = OpenAICompletion("run", client)(PROMPTS, new_tokens, sampling=greedy, key=0, raw=True)
        seconds = time.perf_counter() - began
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    local = task(PROMPTS, new_tokens, seed=0, sampling=greedy).text
    return {"prompts": PROMPTS, "served": served.texts, "local": local, "equal": served.texts == local,
            "served_seconds": round(seconds, 3), "usage": served.usage}


def score_images(run: Path, task, count: int, steps: int) -> dict:
    import numpy as np

    from dew.config.run import RunConfig
    from dew.data.dataset import Partition
    from dew.eval.image_metrics import FID, RandomConvFeatures

    labels = getattr(task, "num_classes", None)
    prompts = [i % labels for i in range(count)] if labels else [None] * count
    drawn = task(prompts, steps=steps, seed=0).host().images
    config = RunConfig.load(run)
    real = next(config.data.load(batch=count).train(Partition.current()))["image"]  # the run's own (uint8) images
    fid = FID(RandomConvFeatures(seed=0), key="samples", reference_key="images")
    scores = fid.result(fid.update(fid.empty(), {"samples": np.asarray(drawn), "images": np.asarray(real)}))
    return {"kind": "images", "samples": int(len(drawn)), "sampling_steps": steps, "fid_random_conv": scores["fid"],
            "sample_range": [float(np.min(drawn)), float(np.max(drawn))]}


def evaluate(run: Path, args) -> dict:
    """The report of one run: its task decides which scores apply."""
    import dew
    from dew.config.run import RUN_FILE, RunConfig

    # a saved run serves its EMA weights when it keeps them; a checkpoint directory has one set
    ema = not (run / RUN_FILE).is_file() or RunConfig.load(run).objective.settings.get("ema_decay") is not None
    task = dew.pipeline(run, ema=ema)
    kind = type(task).__name__
    if kind == "TextGeneration":
        text = Path(args.text).read_text() if args.text else _held_out_text()
        tasks = (Path(args.tasks[0]).resolve(), args.tasks[1:]) if args.tasks else None
        return score_decoder(run, task, ema, text, tasks, args.new_tokens)
    if kind == "TextToImage":
        return score_images(run, task, args.images, args.sampling_steps)
    raise ValueError(f"{run} serves a {kind}; this example scores decoders (TextGeneration) and image runs (TextToImage).")


def _held_out_text() -> str:
    from dew.data.corpora import help_topics_text

    return help_topics_text()[-1500:]  # the tail: the smoke runs train on the head


def smoke_runs(root: Path) -> list[Path]:
    """A tiny LM run and a tiny digits diffusion run, trained by the recipes as a user runs them."""
    from dew.data.corpora import help_topics_text

    corpus = root / "corpus.txt"
    corpus.write_text(help_topics_text()[:20_000])
    common = ["--trainer.checkpoint-dir", str(root), "--trainer.steps", "4", "--trainer.batch-size", "8",
              "--trainer.log-every", "4", "--model.emb-features", "32", "--model.num-layers", "1", "--model.num-heads", "2"]
    lm = ["--trainer.name", "lm", "--data.text", str(corpus), "--data.seq-len", "32", "--model.mlp-features", "64",
          "--new-tokens", "4"]
    images = ["--trainer.name", "digits", "--trainer.eval-every", "None", "--data.image-size", "8", "--data.channels", "1",
              "--model.patch-size", "2", "--sample-steps", "2", "--ema-decay", "0.5"]
    for recipe, extra in (("lm", lm), ("diffusion", images)):
        subprocess.run([sys.executable, str(REPO / "recipes" / recipe / "train.py"), *common, *extra], check=True,
                       stdout=subprocess.DEVNULL)
    return [root / "lm", root / "digits"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="finished run directories (or checkpoint directories)")
    parser.add_argument("--text", help="held-out text for the perplexity (default: Python's help topics, tail)")
    parser.add_argument("--tasks", nargs="+", metavar="DIR_THEN_NAMES", help="a folder of lm-eval task YAMLs, then task names")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per prompt in the served comparison")
    parser.add_argument("--images", type=int, default=64, help="images drawn for the image metrics")
    parser.add_argument("--sampling-steps", type=int, default=20, help="solver steps per image")
    parser.add_argument("--report", default="report.json", help="where the JSON report goes")
    parser.add_argument("--smoke", action="store_true", help="train two tiny runs offline first and score those")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        runs = [Path(r) for r in args.runs]
        if args.smoke:
            args.new_tokens, args.images, args.sampling_steps = 4, 16, 2
            args.tasks = args.tasks or [str(REPO / "tests" / "fixtures" / "harness" / "tasks"), "dew_tiny_mc", "dew_tiny_perplexity"]
            runs = smoke_runs(Path(scratch))
        if not runs:
            parser.error("give one or more run directories, or --smoke")
        report = {str(run): evaluate(run, args) for run in runs}
    from dew.files import write_atomic

    write_atomic(args.report, json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
