"""Load a Dew export with transformers and print its logits as JSON (used by tests/test_interop.py).

    .venv-ref/bin/python tools/hf_check_export.py DIR --ids '[[3, 4, 5], [6, 7, 8]]'

prints ``{"model_type", "architectures", "logits": [batch][length][vocab], "tokenizer_vocab"}``;
``tokenizer_vocab`` is the size of the tokenizer AutoTokenizer reads from DIR (null when there is
none). Run it with the reference environment (torch CPU + transformers), not Dew's.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--ids", required=True, help="token ids as a JSON list of equal-length rows")
    args = parser.parse_args()

    options = {}
    quantization = json.loads((args.directory / "config.json").read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") == "fp8":  # FP8 blocks read as float32 (not the CPU default, bf16)
        options["quantization_config"] = transformers.FineGrainedFP8Config(
            dequantize=True, weight_block_size=quantization.get("weight_block_size"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.directory, dtype=torch.float32, attn_implementation="eager", **options
    ).eval()
    ids = torch.tensor(json.loads(args.ids), dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits.float()
    vocab = None
    if (args.directory / "tokenizer.json").is_file():
        vocab = len(transformers.AutoTokenizer.from_pretrained(args.directory))
    print(json.dumps({
        "model_type": model.config.model_type,
        "architectures": model.config.architectures,
        "logits": logits.tolist(),
        "tokenizer_vocab": vocab,
    }))


if __name__ == "__main__":
    main()
