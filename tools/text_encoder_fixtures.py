"""Build tiny CLIP and T5 text encoders with their tokenizers and record what transformers computes.

Writes one directory per encoder under tests/fixtures/text_encoders/, read by tests/test_text_encoders.py:

    config.json, model.safetensors          (save_pretrained, float32)
    tokenizer.json, tokenizer_config.json   (the tokenizer, trained here on CAPTIONS)
    reference.npz   input_ids, attention_mask [3, 16] (CLIP) or [3, 32] (T5): CAPTIONS through the transformers
                    tokenizer (padding="max_length", truncation=True; the last caption is cut)
                    and what the encoder returns for them:
                    CLIP: last (last_hidden_state), penultimate (hidden_states[-2]), pooled
                          (pooler_output), projected (text_embeds), masked_last (last_hidden_state
                          with the attention mask passed)
                    T5:   last (last_hidden_state), masked_last (with the attention mask)

The structures are the released ones at small widths:

    "clip"       CLIPTextModelWithProjection as OpenAI's CLIP ViT-L/14 (SD 1.x, SDXL's first
                 encoder, Flux's pooled one): quick_gelu, pad = <|endoftext|>, the config's
                 eos_token_id the real EOS id (pooled at its first position).
    "clip-gelu"  as OpenCLIP ViT-H / bigG (SD 2.x, SDXL's second encoder): gelu, pad "!", and the
                 legacy eos_token_id 2 (pooled at the highest id, the argmax rule).
    "t5"         T5EncoderModel as T5 v1.1 XXL (SD3, Flux): gated-gelu feed-forward, untied,
                 relative position buckets, RMS layer norms.
    "t5-relu"    the original T5's ReLU feed-forward.

Weights are drawn wider than the models' initializers and norm weights moved off 1 so that a
wrong activation, pooling rule or bucket setting changes the outputs far beyond the tolerance.

Run with the reference environment (torch CPU + transformers), not Dew's:

    .venv-ref/bin/python tools/text_encoder_fixtures.py
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/text_encoders"
MAX_LENGTH = 16  # CLIP's context (77 in the releases)
T5_MAX_LENGTH = 32  # T5 has no position table; 256 or 512 in SD3 and Flux
CAPTIONS = [
    "a handwritten seven",
    "The digit 7, drawn in ink!",
    "a photograph of a red flower with long petals beside a small grey stone in the morning light",
]
CORPUS = CAPTIONS + [
    "a handwritten zero", "a handwritten one", "a handwritten two", "a handwritten three",
    "the digit 0", "the digit 1", "the digit 2", "the digit 3", "the digit 4", "the digit 5",
    "a photo of a cat", "a photo of a dog", "a painting of a flower", "a drawing of a house",
    "red green blue yellow white black grey", "in the morning light, beside the river",
]


def clip_tokenizer(pad_token):
    """A CLIP BPE tokenizer over CORPUS: byte-level symbols with </w>, special tokens last (as CLIP)."""
    trainer_tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    probe = transformers.CLIPTokenizer()
    trainer_tokenizer.normalizer = probe.backend_tokenizer.normalizer
    trainer_tokenizer.pre_tokenizer = probe.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=360, end_of_word_suffix="</w>", show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_tokenizer.train_from_iterator(CORPUS, trainer)
    learned = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = dict(learned["vocab"])
    for token in (pad_token, "<|startoftext|>", "<|endoftext|>"):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in learned["merges"]]
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token,
                                      model_max_length=MAX_LENGTH)


def t5_tokenizer():
    """A T5 Unigram tokenizer over CORPUS: <pad> 0, </s> 1, <unk> 2, as T5's."""
    trainer_tokenizer = Tokenizer(models.Unigram())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    trainer_tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = [(piece, float(score)) for piece, score in json.loads(trainer_tokenizer.to_str())["model"]["vocab"]]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)


CLIP_SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  max_position_embeddings=MAX_LENGTH, projection_dim=24, layer_norm_eps=1e-5)
T5_SIZES = dict(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, relative_attention_num_buckets=8,
                relative_attention_max_distance=12, layer_norm_epsilon=1e-6, dropout_rate=0.0)


def clip_fixture(pad_token, hidden_act, legacy_eos, num_layers):
    tokenizer = clip_tokenizer(pad_token)
    eos = 2 if legacy_eos else tokenizer.eos_token_id
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), num_hidden_layers=num_layers, hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        **CLIP_SIZES)
    return tokenizer, transformers.CLIPTextModelWithProjection(config)


def t5_fixture(feed_forward_proj):
    tokenizer = t5_tokenizer()
    config = transformers.T5Config(vocab_size=len(tokenizer), feed_forward_proj=feed_forward_proj,
                                   tie_word_embeddings=False, **T5_SIZES)
    return tokenizer, transformers.T5EncoderModel(config)


FIXTURES = {
    "clip": lambda: clip_fixture("<|endoftext|>", "quick_gelu", legacy_eos=False, num_layers=3),
    "clip-gelu": lambda: clip_fixture("!", "gelu", legacy_eos=True, num_layers=2),
    "t5": lambda: t5_fixture("gated-gelu"),
    "t5-relu": lambda: t5_fixture("relu"),
}
WEIGHT_STD = 0.2


def randomize(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            elif "relative_attention_bias" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(WEIGHT_STD * torch.randn(tensor.shape, generator=generator))


def record(name, seed):
    torch.manual_seed(seed)
    tokenizer, model = FIXTURES[name]()
    model = model.to(torch.float32).eval()
    randomize(model, seed)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)

    length = MAX_LENGTH if name.startswith("clip") else T5_MAX_LENGTH
    batch = tokenizer(CAPTIONS, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    outputs = {"input_ids": ids.numpy().astype(np.int32), "attention_mask": mask.numpy().astype(np.int32)}
    with torch.no_grad():
        if name.startswith("clip"):
            plain = model(input_ids=ids, output_hidden_states=True)
            pooled = model.text_model(input_ids=ids).pooler_output
            outputs.update(last=plain.last_hidden_state, penultimate=plain.hidden_states[-2], pooled=pooled,
                           projected=plain.text_embeds,
                           masked_last=model(input_ids=ids, attention_mask=mask).last_hidden_state)
        else:
            outputs.update(last=model(input_ids=ids).last_hidden_state,
                           masked_last=model(input_ids=ids, attention_mask=mask).last_hidden_state)
    arrays = {key: np.asarray(value, dtype=np.float32) if torch.is_tensor(value) else value
              for key, value in outputs.items()}
    np.savez_compressed(directory / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in directory.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, vocab {len(tokenizer)}, ids {arrays['input_ids'].tolist()}")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FIXTURES):
        record(name, seed)


if __name__ == "__main__":
    main()
