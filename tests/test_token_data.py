"""Token corpora: tokenize writes them atomically, TokenWindows reads them as resumable batches."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from dew.data import Partition
from dew.data import tokens as tokens_module
from dew.data.tokenizers import ByteTokenizer, HFTokenizer
from dew.data.tokens import TokenCorpus, TokenWindows, document_segments, token_dtype, tokenize

ROOT = Path(__file__).resolve().parent.parent
TINY_TOOLS = ROOT / "tests/fixtures/tokenizers/tiny-tools"


def _python_docs(count: int = 12) -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)[:count]]


def _arange_corpus(directory: Path, train: int, val: int, *, eos_id=None) -> Path:
    """A corpus whose ids are their own positions, so a window shows where it was cut."""
    directory.mkdir(parents=True)
    np.arange(val, dtype=np.uint16).tofile(directory / "val.bin")
    np.arange(train, dtype=np.uint16).tofile(directory / "train.bin")
    meta = {"vocab_size": 65536, "dtype": "uint16", "train_tokens": train, "val_tokens": val,
            "tokenizer": "byte", "eos_id": eos_id}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def _rows(iterator, count: int) -> np.ndarray:
    return np.concatenate([next(iterator)["text"] for _ in range(count)])


# ----------------------------------------------------------------------------------------------
# tokenize


def test_tokenize_writes_train_val_and_meta_with_val_the_head_of_the_stream(tmp_path):
    text = "\n\n".join(_python_docs(6))
    (tmp_path / "in.txt").write_text(text)
    corpus = tokenize(tmp_path / "in.txt", tmp_path / "out", "byte", val_fraction=0.1)
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]
    ids = np.frombuffer(text.encode(), np.uint8)
    val = len(ids) // 10
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out/val.bin", np.uint16), ids[:val])
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out/train.bin", np.uint16), ids[val:])
    meta = json.loads((tmp_path / "out/meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["tokenizer"] == "byte"
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(ids) - val, val)
    assert meta["pack"] is False and meta["eos_id"] is None
    assert corpus.tokenizer == "byte" and corpus.eos_id is None and corpus.vocab_size == 256
    assert isinstance(corpus.train, np.memmap) and len(corpus.val) == val


def test_streaming_in_small_chunks_gives_the_ids_of_the_whole_text(tmp_path, monkeypatch):
    tokenizer = HFTokenizer(TINY_TOOLS)
    text = "\n".join(_python_docs(8)) + "\r\nend  \n\n  x\n\n\n" + "a" * 300 + "\n \n"
    (tmp_path / "in.txt").write_text(text, newline="")
    monkeypatch.setattr(tokens_module, "_CHUNK_CHARS", 97)
    corpus = tokenize(tmp_path / "in.txt", tmp_path / "out", tokenizer, val_fraction=0.0)
    np.testing.assert_array_equal(corpus.train, tokenizer.encode(text))
    assert len(corpus.val) == 0


def test_dtype_is_uint16_up_to_65536_ids_and_uint32_beyond(tmp_path):
    assert token_dtype(256) == token_dtype(65536) == np.uint16
    assert token_dtype(65537) == token_dtype(151_936) == np.uint32

    class WideTokenizer(ByteTokenizer):
        vocab_size = 70_000

        def encode(self, text):
            return [69_000 + b for b in text.encode()]

    (tmp_path / "in.txt").write_text("wide ids " * 20)
    corpus = tokenize(tmp_path / "in.txt", tmp_path / "out", WideTokenizer())
    assert corpus.meta["dtype"] == "uint32" and corpus.train.dtype == np.uint32
    assert corpus.train.min() >= 69_000
    assert (tmp_path / "out/train.bin").stat().st_size == 4 * corpus.meta["train_tokens"]


def test_a_directory_tokenizer_is_copied_into_the_corpus_and_rebuilt_from_it(tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(_python_docs(3)))
    corpus = tokenize(tmp_path / "in.txt", tmp_path / "out", str(TINY_TOOLS))
    copied = tmp_path / "out/tokenizer"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(copied))
    assert corpus.meta["tokenizer"] == "tokenizer"
    assert corpus.meta["tokenizer_source"] == str(TINY_TOOLS.resolve())
    assert Path(corpus.tokenizer) == copied.resolve()
    rebuilt = HFTokenizer(corpus.tokenizer)
    assert rebuilt.vocab_size == corpus.vocab_size == 512
    head = rebuilt.decode(np.concatenate([corpus.val, corpus.train])[:200])
    assert (tmp_path / "in.txt").read_text().startswith(head)


def test_pack_ends_each_blank_line_separated_document_with_eos_and_records_it(tmp_path):
    (tmp_path / "in.txt").write_text("first doc\nline two\n\n\nsecond\n\nthird one\n")
    corpus = tokenize(tmp_path / "in.txt", tmp_path / "out", "byte", val_fraction=0.0, pack=True)
    expected = b"first doc\nline two\0second\0third one\0"
    assert bytes(np.asarray(corpus.train, np.uint8)) == expected
    assert corpus.eos_id == corpus.meta["eos_id"] == 0
    assert corpus.meta["pack"] is True and corpus.meta["documents"] == 3


def test_pack_splits_documents_at_the_tokenizers_eos_text(tmp_path, monkeypatch):
    tokenizer = HFTokenizer(TINY_TOOLS)
    docs = _python_docs(5)
    (tmp_path / "in.txt").write_text("\n<|endoftext|>\n".join(docs) + "\n<|endoftext|>\n")
    monkeypatch.setattr(tokens_module, "_CHUNK_CHARS", 1000)  # separators straddle the chunks
    corpus = tokenize(tmp_path / "in.txt", tmp_path / "out", TINY_TOOLS, val_fraction=0.0, pack=True)
    expected = [i for doc in docs for i in tokenizer.encode(doc.strip("\r\n")) + [tokenizer.eos_id]]
    np.testing.assert_array_equal(corpus.train, expected)
    assert corpus.eos_id == tokenizer.eos_id and corpus.meta["documents"] == 5


class _FailingTokenizer(ByteTokenizer):
    def __init__(self, calls: int):
        self.calls = calls

    def encode(self, text):
        self.calls -= 1
        if self.calls < 0:
            raise RuntimeError("tokenizer broke mid-file")
        return super().encode(text)


def test_a_failure_mid_tokenize_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens_module, "_CHUNK_CHARS", 50)
    (tmp_path / "in.txt").write_text("a line of text\n" * 40)
    with pytest.raises(RuntimeError, match="mid-file"):
        tokenize(tmp_path / "in.txt", tmp_path / "new", _FailingTokenizer(calls=3))
    assert not (tmp_path / "new").exists()

    # Over an existing corpus, a failure leaves the old corpus as it was and no temporary files.
    old = tokenize(tmp_path / "in.txt", tmp_path / "old", "byte")
    before = {name: (tmp_path / "old" / name).read_bytes() for name in os.listdir(tmp_path / "old")}
    with pytest.raises(RuntimeError, match="mid-file"):
        tokenize(tmp_path / "in.txt", tmp_path / "old", _FailingTokenizer(calls=3))
    after = {name: (tmp_path / "old" / name).read_bytes() for name in os.listdir(tmp_path / "old")}
    assert after == before and len(old.train) > 0

    (tmp_path / "bad.txt").write_bytes(b"good text\n" * 20 + b"\xff\xfe not utf-8\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        tokenize(tmp_path / "bad.txt", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_tokenize_names_what_it_expected_when_given_bad_arguments(tmp_path):
    (tmp_path / "in.txt").write_text("some text\n")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        tokenize(tmp_path / "missing.txt", tmp_path / "out")
    with pytest.raises(ValueError, match=r"val_fraction.*\[0, 1\).*1.5"):
        tokenize(tmp_path / "in.txt", tmp_path / "out", val_fraction=1.5)
    with pytest.raises(ValueError, match="'gpt2'.*'byte', a local directory holding tokenizer.json, or a Hub repository id"):
        tokenize(tmp_path / "in.txt", tmp_path / "out", "gpt2")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no text"):
        tokenize(tmp_path / "empty.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_runs_tokenize_and_prints_one_summary_line(tmp_path, capsys):
    from dew.cli.tokenize import run

    (tmp_path / "in.txt").write_text("one\n\ntwo\n\nthree\n")
    corpus = run(str(tmp_path / "in.txt"), str(tmp_path / "out"), pack=True, val_fraction=0.0)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "3 documents" in lines[0] and "uint16" in lines[0]
    assert corpus.meta["train_tokens"] == len("onetwothree") + 3


# ----------------------------------------------------------------------------------------------
# TokenWindows


def test_windows_hold_seq_len_plus_one_consecutive_ids(tmp_path):
    path = _arange_corpus(tmp_path / "c", train=1000, val=100)
    data = TokenWindows(str(path), seq_len=16).load(batch=8)
    assert data.records == (1000 - 16) // 16 and data.batch == 8
    batch = next(data.train(Partition()))
    assert list(batch) == ["text"]
    assert batch["text"].shape == (8, 17) and batch["text"].dtype == np.int32
    assert np.all(np.diff(batch["text"], axis=1) == 1)
    assert batch["text"].max() < 1000


def test_each_epoch_reads_every_window_once_in_a_fresh_order_and_offset_from_the_seed(tmp_path):
    path = _arange_corpus(tmp_path / "c", train=16 * 40 + 9, val=0)
    windows = TokenWindows(str(path), seq_len=16, seed=3)
    data = windows.load(batch=6)
    records = data.records
    starts = _rows(data.train(Partition()), 20)[:, 0]  # 120 rows: three epochs of 39
    epochs = [starts[i * records : (i + 1) * records] for i in range(3)]
    for epoch in epochs:
        assert len(set(epoch.tolist())) == records  # every window once
        assert len(set((epoch % 16).tolist())) == 1  # one offset per epoch
        assert epoch.max() + 17 <= 16 * 40 + 9
    assert [e[0] % 16 for e in epochs] != [epochs[0][0] % 16] * 3  # the offset moves
    assert not np.array_equal(np.sort(epochs[0]) - epochs[0][0] % 16, epochs[1] - epochs[1][0] % 16)
    assert not np.array_equal(epochs[0] // 16, epochs[1] // 16)  # a fresh order

    again = _rows(windows.load(batch=6).train(Partition()), 20)[:, 0]
    np.testing.assert_array_equal(again, starts)  # the same seed draws the same epochs
    other = _rows(dataclasses.replace(windows, seed=4).load(batch=6).train(Partition()), 20)[:, 0]
    assert not np.array_equal(other, starts)


def test_set_state_resumes_exactly_where_get_state_was_taken(tmp_path):
    path = _arange_corpus(tmp_path / "c", train=2000, val=0)
    data = TokenWindows(str(path), seq_len=32, seed=1).load(batch=4)
    iterator = data.train(Partition())
    _rows(iterator, 17)  # past the end of the first 15-batch epoch
    state = iterator.get_state()
    expected = _rows(iterator, 20)

    resumed = data.train(Partition())
    resumed.set_state(state)
    np.testing.assert_array_equal(_rows(resumed, 20), expected)
    assert not np.array_equal(_rows(data.train(Partition()), 20), expected)


def test_two_processes_read_disjoint_halves_of_the_same_global_batch(tmp_path):
    path = _arange_corpus(tmp_path / "c", train=3000, val=35 * 20 + 1)
    data = TokenWindows(str(path), seq_len=20, pack=False).load(batch=8)
    whole, first, second = (data.train(p) for p in (Partition(), Partition(0, 2), Partition(1, 2)))
    for _ in range(5):
        a, b = next(first)["text"], next(second)["text"]
        assert a.shape == b.shape == (4, 21)
        np.testing.assert_array_equal(np.concatenate([a, b]), next(whole)["text"])
        assert not set(a[:, 0].tolist()) & set(b[:, 0].tolist())
    halves = zip(data.val(Partition(0, 2)), data.val(Partition(1, 2)), strict=True)
    merged = [np.concatenate([a["text"], b["text"]]) for a, b in halves]
    wholes = [batch["text"] for batch in data.val(Partition())]
    # 35 windows: four batches of 8, then 3 rows, which one process reads whole but two cannot split.
    assert [len(w) for w in wholes] == [8, 8, 8, 8, 3] and len(merged) == 4
    for m, w in zip(merged, wholes[:4]):
        np.testing.assert_array_equal(m, w)


def test_validation_reads_val_windows_once_in_order_and_drops_the_ragged_tail(tmp_path):
    path = _arange_corpus(tmp_path / "c", train=500, val=170)
    data = TokenWindows(str(path), seq_len=16).load(batch=4)
    batches = list(data.val(Partition()))
    rows = np.concatenate([batch["text"] for batch in batches])
    assert [len(batch["text"]) for batch in batches] == [4, 4, 2]  # (170 - 1) // 16 = 10 windows
    np.testing.assert_array_equal(rows[:, 0], np.arange(10) * 16)
    np.testing.assert_array_equal(rows, np.arange(10)[:, None] * 16 + np.arange(17))
    assert list(data.val(Partition())) and len(list(data.val(Partition()))) == 3  # a fresh pass


def test_document_segments_restart_after_each_eos():
    text = np.array([[5, 6, 0, 7, 0, 0, 8, 9], [0, 1, 2, 3, 4, 5, 6, 0]])
    segment_ids, positions = document_segments(text, eos_id=0)
    np.testing.assert_array_equal(segment_ids, [[1, 1, 1, 2, 2, 3, 4, 4], [1, 2, 2, 2, 2, 2, 2, 2]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]])


def test_packed_rows_number_documents_and_restart_positions_at_each_eos(tmp_path):
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdefgh"), size=n)) for n in rng.integers(1, 30, size=60)]
    (tmp_path / "in.txt").write_text("\n\n".join(docs))
    tokenize(tmp_path / "in.txt", tmp_path / "out", "byte", pack=True, val_fraction=0.1)
    data = TokenWindows(str(tmp_path / "out"), seq_len=24, pack=True).load(batch=8)
    batch = next(data.train(Partition()))
    assert sorted(batch) == ["positions", "segment_ids", "text"]
    for key in batch:
        assert batch[key].shape == (8, 25) and batch[key].dtype == np.int32
    for text, segments, positions in zip(batch["text"], batch["segment_ids"], batch["positions"]):
        assert segments[0] == 1 and positions[0] == 0 and segments.min() >= 1
        after_eos = np.flatnonzero(text[:-1] == 0) + 1
        assert (np.diff(segments) == 1).sum() == len(after_eos)
        np.testing.assert_array_equal(positions[after_eos], 0)
        np.testing.assert_array_equal(np.diff(segments)[after_eos - 1], 1)
        inside = np.setdiff1d(np.arange(1, 25), after_eos)
        np.testing.assert_array_equal(positions[inside], positions[inside - 1] + 1)
    assert (batch["segment_ids"].max(axis=1) > 1).all()  # short documents share rows
    val = next(data.val(Partition()))
    assert sorted(val) == ["positions", "segment_ids", "text"]


def test_token_windows_is_a_frozen_config_record_without_a_path(tmp_path):
    record = TokenWindows(seq_len=16)
    assert record.path is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.seq_len = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="path is None"):
        record.load(batch=2)
    path = _arange_corpus(tmp_path / "c", train=100, val=0)
    data = dataclasses.replace(record, path=str(path)).load(batch=2)
    assert data.val is None and next(data.train(Partition()))["text"].shape == (2, 17)


def test_reading_names_what_was_expected_and_what_was_given(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist.*dew tokenize"):
        TokenWindows(str(tmp_path / "nowhere"), seq_len=8).load(batch=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty/train.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"meta.json.*\['train.bin'\]"):
        TokenCorpus.read(tmp_path / "empty")

    path = _arange_corpus(tmp_path / "c", train=100, val=30)
    with pytest.raises(ValueError, match=r"seq_len=128 needs 129 ids.*train.bin.*holds 100"):
        TokenWindows(str(path), seq_len=128).load(batch=2)
    with pytest.raises(ValueError, match=r"seq_len=40 needs 41 ids.*val.bin.*holds 30"):
        TokenWindows(str(path), seq_len=40).load(batch=2)
    for batch in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match=f"TokenWindows.load batch must be a positive integer; got {batch!r}"):
            TokenWindows(str(path), seq_len=8).load(batch=batch)
    with pytest.raises(ValueError, match="TokenWindows.seq_len must be a positive integer; got 0"):
        TokenWindows(str(path), seq_len=0)
    assert TokenWindows(str(path), seq_len=np.int64(8)).load(batch=np.int64(2)).batch == 2
    with pytest.raises(ValueError, match="pack=True.*eos_id is null.*--pack"):
        TokenWindows(str(path), seq_len=8, pack=True).load(batch=2)

    (path / "train.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="holds 5 uint16 ids but meta.json says 100"):
        TokenCorpus.read(path)
