"""The `dew` command. Each subcommand is a function; `dew --help` lists them."""

from __future__ import annotations

import sys

from tyro.conf import Positional

from dew.cli import checkpoints, demo, launch, plan, serve, tokenize  # each imports its heavy dependencies inside its function


def _export(run: Positional[str], dest: Positional[str], step: int | None = None, live: bool = False,
            overwrite: bool = False, merged: bool = False) -> None:
    """Export a saved decoder run to the Hugging Face layout (config.json, model.safetensors,
    generation_config.json, tokenizer files) that transformers, vLLM and llama.cpp read.

    A run that trained a LoRA adapter is written as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) naming its base; `--merged` writes the base with the adapter folded
    in as a full model instead."""
    from dew.interop import PretrainedDecoder

    bundle = PretrainedDecoder.from_run(run, step=step, ema=not live)
    adapted = callable(getattr(bundle, "save_adapter", None))
    if merged and not adapted:
        raise ValueError(f"--merged folds a LoRA adapter into its base, but {run} trains every weight; export it without --merged")
    if adapted and not merged:
        bundle.save_adapter(dest, overwrite=overwrite)
        print(f"exported {run}'s LoRA adapter for {bundle.base.source} to {dest}")
        return
    if adapted:
        bundle = bundle.merge()
    bundle.save(dest, overwrite=overwrite)
    print(f"exported {run} as {bundle.config.get('model_type')} to {dest}")


COMMANDS = {
    "demo": demo.run,
    "tokenize": tokenize.run,
    "export": _export,
    "checkpoints": checkpoints.run,
    "serve": serve.run,
    "plan": plan.run,
}


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand. Bad input (a missing file, a damaged checkpoint, a wrong setting) ends
    with Dew's message on stderr and exit status 1; ``DEW_TRACEBACK=1`` shows the traceback too."""
    import os

    import tyro

    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["launch"]:  # argparse: everything after -- is the command, passed through untouched
            raise SystemExit(launch.main(args[1:]))
        tyro.extras.subcommand_cli_from_dict(COMMANDS, args=args, prog="dew")
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as error:
        if os.environ.get("DEW_TRACEBACK"):
            raise
        print(f"dew: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
