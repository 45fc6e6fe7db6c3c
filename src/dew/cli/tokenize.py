"""`dew tokenize`: a text file into the train.bin / val.bin / meta.json that TokenWindows reads."""

from __future__ import annotations


def run(
    input: str,
    out: str,
    tokenizer: str = "byte",
    val_fraction: float = 0.01,
    pack: bool = False,
):
    """Tokenize a UTF-8 text file into a token corpus directory.

    Args:
        input: The text file to read.
        out: The directory to write train.bin, val.bin and meta.json into (created if missing).
        tokenizer: "byte" (UTF-8 bytes, 256 ids), a local directory holding tokenizer.json, or a Hub
            repository id read through the Hugging Face cache (HF_HUB_OFFLINE=1 reads only the cache); its
            files are copied into OUT/tokenizer so the corpus carries its tokenizer.
        val_fraction: The share of tokens held out for validation, taken from the head of the text.
        pack: Treat the input as documents separated by the tokenizer's end-of-text text
            (<|endoftext|>; a blank line for "byte"), end each with the EOS id, and record that id
            for TokenWindows(pack=True).
    """
    from dew.data.tokens import tokenize

    corpus = tokenize(input, out, tokenizer, val_fraction=val_fraction, pack=pack)
    meta = corpus.meta
    documents = f", {meta['documents']:,} documents (eos_id {meta['eos_id']})" if pack else ""
    print(
        f"{out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, "
        f"{meta['dtype']}, vocab {meta['vocab_size']:,}, "
        f"tokenizer {meta['tokenizer_source']}{documents}"
    )
    return corpus
