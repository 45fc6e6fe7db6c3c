"""Train PEFT LoRA adapters on the tiny decoder fixtures and record what they compute.

Writes, read by tests/test_lora.py:

    tests/fixtures/peft/llama-lora/       every projection of tests/fixtures/hf/llama
    tests/fixtures/peft/qwen3-moe-lora/   q_proj and the experts' stacked gate_up_proj / down_proj
                                          (target_parameters) of tests/fixtures/hf/qwen3_moe
    tests/fixtures/peft/gpt-oss-lora/     the same on tests/fixtures/hf/gpt_oss, whose fused
                                          gate_up_proj [experts, in, out] interleaves gate and up
    tests/fixtures/peft/deepseek-v3-lora/ the latent attention's q_b_proj and o_proj and the routed
                                          experts of tests/fixtures/hf/deepseek_v3 (whose first
                                          layer is dense)

each holding:

    adapter_config.json, adapter_model.safetensors   (PeftModel.save_pretrained)
    reference.npz   input_ids [2, 12], the adapted model's logits [2, 12, vocab] and the base's

The adapter covers every projection (q, k, v, o, gate, up, down) at rank 4 with alpha 8, so its
scale is 2 (a load that drops the scale is caught), and is trained with AdamW for a few steps on
random tokens, so both factors are far from their initial values (lora_B starts at zero).
The base is tests/fixtures/hf/llama (written by tools/hf_decoder_fixtures.py); its name in
adapter_config.json is that path relative to the repository.

Run with the reference environment (torch CPU, transformers, peft), from anywhere, naming the
adapters to record (all by default):

    .venv-ref/bin/python tools/peft_adapter_fixture.py
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import numpy as np
import peft
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = 7
STEPS = 20


def record(base: str, out: pathlib.Path, config: peft.LoraConfig) -> None:
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                              attn_implementation="eager")
    adapted = peft.get_peft_model(model, config)
    rng = np.random.default_rng(SEED)
    vocab = model.config.vocab_size
    train = torch.from_numpy(rng.integers(3, vocab, size=(4, 16)).astype(np.int64))
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=3e-2)
    adapted.train()
    for _ in range(STEPS):
        loss = adapted(input_ids=train, labels=train).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    adapted.eval()

    input_ids = torch.from_numpy(rng.integers(3, vocab, size=(2, 12)).astype(np.int64))
    with torch.no_grad():
        logits = adapted(input_ids=input_ids).logits.float().numpy()
        with adapted.disable_adapter():
            base_logits = adapted(input_ids=input_ids).logits.float().numpy()

    shutil.rmtree(out, ignore_errors=True)
    adapted.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template, not needed
    np.savez_compressed(out / "reference.npz", input_ids=input_ids.numpy().astype(np.int32),
                        logits=logits.astype(np.float32), base_logits=base_logits.astype(np.float32))
    size = sum(path.stat().st_size for path in out.iterdir())
    print(f"final loss {loss.item():.4f}; adapted vs base logits differ by up to "
          f"{np.abs(logits - base_logits).max():.3f}; {size / 1024:.0f} KiB in {out}")


ADAPTERS = {
    "llama-lora": ("tests/fixtures/hf/llama", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])),
    "qwen3-moe-lora": ("tests/fixtures/hf/qwen3_moe", dict(
        r=2, lora_alpha=6, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    "gpt-oss-lora": ("tests/fixtures/hf/gpt_oss", dict(
        r=2, lora_alpha=6, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    "deepseek-v3-lora": ("tests/fixtures/hf/deepseek_v3", dict(
        r=2, lora_alpha=6, target_modules=["q_b_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


def main(names: list[str]) -> None:
    """Record the named adapters (all of them when none is named)."""
    os.chdir(ROOT)  # so the adapters name their bases by the relative path
    for name in names or ADAPTERS:
        base, settings = ADAPTERS[name]
        record(base, ROOT / "tests/fixtures/peft" / name,
               peft.LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **settings))


if __name__ == "__main__":
    main(sys.argv[1:])
