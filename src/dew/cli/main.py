"""The `dew` command. Each subcommand is a function; `dew --help` lists them."""

from __future__ import annotations

import sys

from tyro.conf import Positional


def _demo(
    out: str = "runs/demo",
    parts: tuple[str, ...] = ("lm", "digits"),
    lm_steps: int = 1500,
    digits_steps: int = 1500,
    curve_steps: int = 600,
    fresh: bool = True,
) -> None:
    """Run the main job on an embedded default: a small decoder trained on Python's help text
    (a saved run and a greedy continuation) and a class-conditional DiT on scikit-learn's digits
    (runs/demo/digits/samples.png). Parts: lm, digits, curve."""
    from dew.cli import demo

    demo.run(out=out, parts=parts, lm_steps=lm_steps, digits_steps=digits_steps,
             curve_steps=curve_steps, fresh=fresh)


def _tokenize(
    input: str, out: str, tokenizer: str = "byte", val_fraction: float = 0.01, pack: bool = False
) -> None:
    """Tokenize a text file into train.bin, val.bin and meta.json (the head of the stream is validation)."""
    from dew.cli import tokenize

    tokenize.run(input=input, out=out, tokenizer=tokenizer, val_fraction=val_fraction, pack=pack)


def _export(run: Positional[str], dest: Positional[str], step: int | None = None, live: bool = False, overwrite: bool = False) -> None:
    """Export a saved decoder run to the Hugging Face layout (config.json, model.safetensors,
    generation_config.json, tokenizer files) that transformers, vLLM and llama.cpp read."""
    from dew.interop import PretrainedDecoder

    bundle = PretrainedDecoder.from_run(run, step=step, averaged=not live)
    bundle.save(dest, overwrite=overwrite)
    print(f"exported {run} as {bundle.config.get('model_type')} to {dest}")


COMMANDS = {
    "demo": _demo,
    "tokenize": _tokenize,
    "export": _export,
}


def main(argv: list[str] | None = None) -> None:
    import tyro

    args = sys.argv[1:] if argv is None else argv
    tyro.extras.subcommand_cli_from_dict(COMMANDS, args=args, prog="dew")


if __name__ == "__main__":
    main()
