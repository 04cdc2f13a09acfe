"""Tests for data.py: the tokenizer (special pieces, offsets into the original text, every character
reachable), the masked-LM stream (masking statistics, alpha sampling, sharding, exact resume, no padding,
bad input) and the XTREME task readers (every shared file reads; bad input is named by file
and line; CRLF and a byte order mark are read alike)."""

import functools
import hashlib
import io
import itertools
import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

import data
from configs import CONFIGS
from evaluate import CLASSIFICATION_LABELS, TAGGING_LABELS

REPO = Path(__file__).parent
SHARED = REPO.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A 1000-piece model of the bundled sample corpus (10 languages)."""
    return data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 1000,
                                               str(tmp_path_factory.mktemp("spm") / "sample")))


def restore(batch):
    """The batch's input ids with the masked positions put back to their original pieces."""
    ids = batch["input_ids"].clone()
    for b in range(ids.shape[0]):
        real = batch["masked_weights"][b] > 0
        ids[b, batch["masked_positions"][b][real]] = batch["masked_ids"][b][real]
    return ids


def batches_of(loader, n):
    return list(itertools.islice(loader, n))


# ----------------------------------------------------------------------------------------------
# Tokenizer

def decode(tokenizer, ids):
    return tokenizer.sp.decode([int(i) for i in ids])


def test_tokenizer_special_pieces_and_offsets_into_the_original_text(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id) == (0, 1, 2, 3, 4)
    assert tokenizer.vocab_size == 1000
    assert tokenizer.encode("[MASK]") != [tokenizer.mask_id]  # a control symbol: text never becomes one
    # NFKC (full-width letters, the "ﬁ" ligature, an ideographic space), collapsed whitespace, and characters
    # SentencePiece reads as blanks (zero-width space, left-to-right mark, byte order mark).
    text = "  Ｔｈｅ  harbour\u3000town ﬁne,\u200b港口小镇 «Марта»\u200e!\ufeff"
    ids, offsets = tokenizer.encode_with_offsets(text)
    assert ids == tokenizer.encode(text) and len(offsets) == len(ids)
    previous_end = 0
    for start, end in offsets:
        assert previous_end <= start <= end <= len(text)
        if start < end:  # a span never starts or ends with what SentencePiece reads as blank
            assert not tokenizer.is_blank(text[start]) and not tokenizer.is_blank(text[end - 1])
        previous_end = end
    visible = "".join(c for c in text if not tokenizer.is_blank(c))
    assert "".join(text[s:e] for s, e in offsets) == visible  # every visible character once, in order
    assert text[offsets[0][0]:offsets[2][1]].startswith("Ｔｈ")  # the original full-width text, not "Th"
    assert decode(tokenizer, tokenizer.encode("the harbour town")) == "the harbour town"


def test_every_character_has_pieces_of_its_own(tokenizer):
    """Byte fallback: characters the vocabulary lacks (digits and rare ideographs are absent from the sample
    corpus) become their UTF-8 bytes, each character its own pieces, never a run merged into one [UNK]."""
    text = "牛顿阐述了 1687 年的定律"
    ids, offsets = tokenizer.encode_with_offsets(text)
    assert tokenizer.unk_id not in ids
    covered = {i for start, end in offsets for i in range(start, end)}
    assert covered == {i for i, c in enumerate(text) if c != " "}
    ends = {end for _, end in offsets}
    assert all(i + 1 in ends for i, c in enumerate(text) if c != " ")  # a span may end after any character
    assert decode(tokenizer, ids) == text


def test_special_pieces_are_found_by_name_and_a_missing_one_is_an_error(tmp_path):
    corpus = tmp_path / "en.txt"
    corpus.write_text("\n".join(f"sentence number {i} about the harbour" for i in range(200)) + "\n")
    # RemBERT's released model has its own layout: look the pieces up, do not assume ids.
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "other"), vocab_size=40,
                                   unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, minloglevel=2,
                                   control_symbols=["[SEP]", "[MASK]", "[PAD]", "[CLS]"])
    tok = data.Tokenizer(str(tmp_path / "other.model"))
    assert (tok.unk_id, tok.sep_id, tok.mask_id, tok.pad_id, tok.cls_id) == (0, 1, 2, 3, 4)
    assert not set(tok.normal_ids.tolist()) & {0, 1, 2, 3, 4}
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "bare"), vocab_size=40,
                                   minloglevel=2)
    with pytest.raises(data.DataError, match=r"bare.model: no \[PAD\] piece"):
        data.Tokenizer(str(tmp_path / "bare.model"))


def checkpoint_with(path, tokenizer):
    """A directory with what tokenizer_for reads of a pretrain.py checkpoint: its checkpoint.json, well formed."""
    path.mkdir()
    (path / ".metadata").write_bytes(b"")
    (path / "checkpoint.json").write_text(json.dumps({
        "config": asdict(CONFIGS["tiny"]), "train_config": {}, "step": 1, "processes": 1, "tokenizer": tokenizer,
        "sha256": {".metadata": hashlib.sha256(b"").hexdigest()}}))
    return path.name


def test_a_model_finds_its_own_tokenizer_and_refuses_another(tokenizer, tmp_path, monkeypatch):
    other = data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 600, str(tmp_path / "other")))
    # A pretrain.py checkpoint records its tokenizer by absolute path and digest: found from any directory.
    record = {"path": str(Path(tokenizer.model_file).resolve()), "sha256": tokenizer.sha256}
    checkpoint = checkpoint_with(tmp_path / "ckpt-00000001", record)
    monkeypatch.chdir(tmp_path)
    assert data.tokenizer_for(checkpoint).model_file == record["path"]
    assert data.tokenizer_for(checkpoint, tokenizer.model_file).sha256 == tokenizer.sha256  # the same model
    with pytest.raises(data.DataError, match=r"other.model is not the tokenizer ckpt-00000001 was trained with"):
        data.tokenizer_for(checkpoint, other.model_file)
    # A Hugging Face directory: its sentencepiece.model.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "sentencepiece.model").write_bytes(Path(tokenizer.model_file).read_bytes())
    assert data.tokenizer_for("hf").sha256 == tokenizer.sha256
    with pytest.raises(data.DataError, match=r"is not the tokenizer hf was trained with"):
        data.tokenizer_for("hf", other.model_file)
    moved = checkpoint_with(tmp_path / "moved", {**record, "path": str(tmp_path / "moved.model")})
    with pytest.raises(data.DataError, match=r"moved.model, which is not there \(moved\?\); pass --tokenizer"):
        data.tokenizer_for(moved)
    assert data.tokenizer_for(moved, tokenizer.model_file).sha256 == tokenizer.sha256
    changed = tmp_path / "changed.model"
    changed.write_bytes(Path(other.model_file).read_bytes())
    checkpoint = checkpoint_with(tmp_path / "c", {"path": str(changed), "sha256": tokenizer.sha256})
    with pytest.raises(data.DataError, match=r"changed.model has changed since c was trained with it"):
        data.tokenizer_for(checkpoint)
    (tmp_path / "bare").mkdir()  # neither a checkpoint's record nor a sentencepiece.model
    with pytest.raises(data.DataError, match=r"bare: no tokenizer was saved with it; pass --tokenizer"):
        data.tokenizer_for("bare")


def test_vocabulary_sizes_are_soft_limits_above_the_byte_pieces(tmp_path):
    small = data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 400, str(tmp_path / "small\udcff")))
    assert small.vocab_size == 400  # (its name holds the byte 0xff, which SentencePiece's own path arguments refuse)
    for name in ("small\udcff.model", "mine.vocab"):  # a user's file beside: not written over
        (tmp_path / name).write_bytes(b"the user's")
        with pytest.raises(data.DataError, match=r"\.(model|vocab) exists: a tokenizer is not trained over it"):
            data.train_tokenizer(str(REPO / "sample_data"), 400, str(tmp_path / name.rsplit(".", 1)[0]))
        assert (tmp_path / name).read_bytes() == b"the user's"
    for content in (b"", b"the user's"):  # an empty file (which SentencePiece would load as nothing) or another
        (tmp_path / "bad.model").write_bytes(content)
        with pytest.raises(data.DataError, match=r"bad.model: not a SentencePiece model \("):
            data.Tokenizer(tmp_path / "bad.model")
    # 8000 asked of the small sample corpus: the largest vocabulary it holds (a soft limit).
    assert 3000 < data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 8000, str(tmp_path / "big"))).vocab_size < 8000
    for vocab_size in (100, 263, 299):  # (263: SentencePiece's own error, naming the corpus, was said instead)
        with pytest.raises(data.DataError, match=f"vocab_size {vocab_size} leaves no room beside the 256 byte pieces"):
            data.train_tokenizer(str(REPO / "sample_data"), vocab_size, str(tmp_path / "tiny"))


def test_sampling_probabilities_follow_the_formula():
    p = data.sampling_probabilities({"en": 400, "de": 100, "sw": 25}, alpha=0.5)
    assert p == pytest.approx({"en": 20 / 35, "de": 10 / 35, "sw": 5 / 35})
    assert data.sampling_probabilities({"en": 400, "de": 100}, alpha=1.0) == pytest.approx({"en": 0.8, "de": 0.2})


# ----------------------------------------------------------------------------------------------
# Masked-LM stream

def test_special_pieces_in_the_text_never_enter_a_row(tmp_path):
    """A model whose [CLS], [SEP] and [MASK] are user-defined pieces makes them of that text ("[MASK]" in a
    sentence); the loader leaves them out, so a row holds [CLS] and [SEP] at its ends alone and no unmasked [MASK]."""
    corpus = tmp_path / "en.txt"
    corpus.write_text("".join(f"line {i} says [CLS] and [MASK] then [SEP] of the harbour\n" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "user"), vocab_size=40,
                                   pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, minloglevel=2,
                                   pad_piece="[PAD]", user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"])
    tok = data.Tokenizer(str(tmp_path / "user.model"))
    assert tok.cls_id in tok.encode("a [CLS] b")  # what the model does with such text
    for batch in batches_of(data.MLMLoader(str(corpus), tok, batch_size=4, seq_len=32, max_predictions=5), 20):
        original = restore(batch)
        assert not torch.isin(original[:, 1:-1], torch.tensor([tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id])).any()
        masked = batch["input_ids"] == tok.mask_id
        assert masked.sum() == sum(int((batch["input_ids"][b, p[w > 0]] == tok.mask_id).sum()) for b, (p, w) in
                                   enumerate(zip(batch["masked_positions"], batch["masked_weights"])))


def test_masking_statistics_full_rows_and_no_special_token_masked(tokenizer):
    loader = data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=8, seq_len=64, max_predictions=12, seed=1)
    counts = Counter()
    for batch in batches_of(loader, 150):
        assert {k: tuple(v.shape) for k, v in batch.items()} == {
            "input_ids": (8, 64), "token_type_ids": (8, 64), "attention_mask": (8, 64),
            "masked_positions": (8, 12), "masked_ids": (8, 12), "masked_weights": (8, 12)}
        assert batch["masked_weights"].dtype == torch.float32 and batch["input_ids"].dtype == torch.long
        assert batch["attention_mask"].all()  # every row full: no padding rows, no padding at the end
        original = restore(batch)
        assert (original[:, 0] == tokenizer.cls_id).all() and (original[:, -1] == tokenizer.sep_id).all()
        assert not ((original[:, 1:-1] == tokenizer.cls_id) | (original[:, 1:-1] == tokenizer.sep_id)).any()
        for b in range(8):
            n = int(batch["masked_weights"][b].sum())
            assert n == round(64 * 0.15)  # create_pretraining_data.py's count, below max_predictions
            assert batch["masked_weights"][b].tolist() == [1.0] * n + [0.0] * (12 - n)
            positions = batch["masked_positions"][b, :n]
            assert positions.tolist() == sorted(set(positions.tolist()))
            assert ((positions > 0) & (positions < 63)).all()  # never [CLS] or [SEP]
            masked_ids = batch["masked_ids"][b, :n]
            now = batch["input_ids"][b, positions]
            counts["mask"] += int((now == tokenizer.mask_id).sum())
            counts["same"] += int((now == masked_ids).sum())
            counts["random"] += int(((now != tokenizer.mask_id) & (now != masked_ids)).sum())
    total = sum(counts.values())
    assert total == 150 * 8 * 10
    assert counts["mask"] / total == pytest.approx(0.8, abs=0.02)
    assert counts["same"] / total == pytest.approx(0.1, abs=0.015)  # a random piece can be the same piece
    assert counts["random"] / total == pytest.approx(0.1, abs=0.015)


def write_lines(path, lines, per_document=5):
    """Lines with a blank line after every `per_document`."""
    path.write_text("".join(line + "\n" + ("\n" if (i + 1) % per_document == 0 else "") for i, line in enumerate(lines)))


def test_languages_are_drawn_with_alpha_smoothed_frequencies(tokenizer, tmp_path):
    sample = {lang: (REPO / "sample_data" / f"{lang}.txt").read_text().split("\n") for lang in ("en", "ru", "el")}
    sizes = {"en": 400, "ru": 100, "el": 25}
    for lang, n in sizes.items():
        lines = [line for line in sample[lang] if line]
        write_lines(tmp_path / f"{lang}.txt", [lines[i % len(lines)] for i in range(n)])
    loader = data.MLMLoader(str(tmp_path), tokenizer, batch_size=4, seq_len=24, max_predictions=4, seed=3)
    assert loader.probabilities == pytest.approx(data.sampling_probabilities(sizes, 0.5))
    scripts = Counter()
    for batch in batches_of(loader, 400):
        for row in restore(batch):
            text = decode(tokenizer, row[1:-1])
            scripts["ru" if re.search("[а-я]", text) else "el" if re.search("[α-ω]", text) else "en"] += 1
    n = sum(scripts.values())
    for lang, p in loader.probabilities.items():  # 20 : 10 : 5, within 4 standard deviations
        assert scripts[lang] / n == pytest.approx(p, abs=4 * (p * (1 - p) / n) ** 0.5), scripts


def test_a_language_with_fewer_lines_than_streams_keeps_its_share(tokenizer, tmp_path):
    """16 streams, a language of 3 lines: the 13 streams whose byte range holds none of its lines read a
    neighbour's, so every stream draws it with p ∝ n^0.5 (not only the 3 that hold a line)."""
    english = [line for line in (REPO / "sample_data" / "en.txt").read_text().split("\n") if line]
    write_lines(tmp_path / "en.txt", [english[i % len(english)] for i in range(400)])
    write_lines(tmp_path / "ru.txt", [line for line in (REPO / "sample_data" / "ru.txt").read_text().split("\n")
                                      if line][:3])
    loader = data.MLMLoader(str(tmp_path), tokenizer, batch_size=16, seq_len=24, max_predictions=4, seed=8)
    russian = sum(bool(re.search("[а-я]", decode(tokenizer, row[1:-1]))) for batch in batches_of(loader, 100)
                  for row in restore(batch))
    p = 3 ** 0.5 / (3 ** 0.5 + 20)
    assert russian / 1600 == pytest.approx(p, abs=4 * (p * (1 - p) / 1600) ** 0.5)


def test_a_language_without_a_piece_of_text_is_named_not_waited_for(tokenizer, tmp_path):
    (tmp_path / "en.txt").write_text("the harbour town\n")
    (tmp_path / "xx.txt").write_text("\u00a0\n\u00a0\u00a0\n")  # lines of no-break spaces: no pieces at all
    for workers in (0, 1):  # from a DataLoader worker as it is, not wrapped in the worker's traceback
        loader = data.MLMLoader(str(tmp_path), tokenizer, batch_size=1, seq_len=16, max_predictions=2,
                                num_workers=workers)
        with pytest.raises(data.DataError, match="^[^\n]*xx.txt: no text the tokenizer makes pieces of$"):
            batches_of(loader, 200)


def letters(i):
    """A number written with the letters a-j."""
    return "".join("abcdefghij"[int(d)] for d in f"{i:05d}")


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """One language in two files, every line numbered in letters: Naaaaa ... Nadgj."""
    root = tmp_path_factory.mktemp("numbered")
    words = "the harbour town wakes up slowly on winter mornings".split()
    lines = [f"N{letters(i)} " + " ".join(words[:1 + i % len(words)]) for i in range(360)]
    write_lines(root / "en.txt", lines[:200])
    write_lines(root / "en.1.txt", lines[200:], per_document=7)
    return root


def test_ranks_and_workers_read_disjoint_shares_covering_every_line_once(tokenizer, numbered):
    """Each stream's first pass over its share, (2 ranks x 2 workers x 2 rows): together every line once."""
    seen = Counter()
    for rank in range(2):
        loader = data.MLMLoader(str(numbered), tokenizer, batch_size=2, seq_len=24, max_predictions=4, seed=4,
                                rank=rank, world_size=2, num_workers=2, shuffle_bytes=512)
        streams = {}  # (worker, row) -> its pieces in order: lines continue from one row to the next
        for batch in itertools.islice(loader, 120):
            worker = (loader.state_dict()["next_worker"] - 1) % 2  # the worker that made this batch
            for b, row in enumerate(restore(batch)):
                streams.setdefault((worker, b), []).extend(row[1:-1].tolist())
        assert len(streams) == 4
        for pieces in streams.values():
            numbers = re.findall(r"N([a-j]{5})", decode(tokenizer, pieces))
            first_pass = numbers[:next(i for i, n in enumerate(numbers) if n in numbers[:i])]  # until a repeat
            seen.update(first_pass)
    assert sorted(seen) == [letters(i) for i in range(360)] and set(seen.values()) == {1}


def test_documents_by_byte_range_partition_a_file(tmp_path):
    path = tmp_path / "de.txt"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(f"Satz {i}\r\n" + ("  \r\n" if i % 4 == 3 else "")
                                               for i in range(100)).encode())  # a BOM, CRLF, blank lines
    size = path.stat().st_size
    for parts in (1, 3, 7, 50):
        bounds = [size * k // parts for k in range(parts + 1)]
        docs = [doc for a, b in zip(bounds, bounds[1:]) for doc in data.read_chunk(str(path), a, b, size)]
        assert [line.strip() for doc in docs for line in doc] == [f"Satz {i}" for i in range(100)]
        if parts == 1:
            assert [len(doc) for doc in docs] == [4] * 25
    assert data.line_counts([str(path)]) == {str(path): (100, hashlib.sha256(path.read_bytes()).hexdigest())}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_loader_yields_exactly_the_uninterrupted_batches(tokenizer, numbered, num_workers):
    def make():
        return data.MLMLoader([str(numbered), str(REPO / "sample_data" / "ru.txt")], tokenizer, batch_size=3,
                              seq_len=32, max_predictions=5, seed=5, num_workers=num_workers, shuffle_bytes=700)
    rng = torch.get_rng_state()
    straight = batches_of(make(), 70)  # several passes over every share
    # torch's generator is dropout's: a loader that drew from it would shift every mask after a resume.
    assert torch.equal(torch.get_rng_state(), rng)
    for stop in (1, 25, 61):
        first = make()
        head = batches_of(first, stop)
        state = torch.load(_saved(first.state_dict()), weights_only=True)  # as a checkpoint holds it
        resumed = make()
        resumed.load_state_dict(state)
        for a, b in zip(head + batches_of(resumed, 70 - stop), straight, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def _saved(obj):
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_a_step_does_not_depend_on_how_processes_and_accumulation_split_it(tokenizer):
    make = functools.partial(data.MLMLoader, str(REPO / "sample_data"), tokenizer, seq_len=32, max_predictions=5,
                             seed=6)
    whole = batches_of(make(batch_size=4), 10)
    two = [batches_of(make(batch_size=2, rank=r, world_size=2), 10) for r in (0, 1)]
    accumulated = batches_of(make(batch_size=1, grad_accum=2, rank=1, world_size=2), 20)  # rank 1 of 2, 2 x 1 rows
    for step in range(10):
        for k in whole[step]:
            assert torch.equal(whole[step][k], torch.cat([two[0][step][k], two[1][step][k]]))
            # rows of micro-batch a of rank r: (a * 2 + r) * 1, i.e. rows 1 and 3 of the step
            assert torch.equal(whole[step][k][[1, 3]], torch.cat([b[k] for b in accumulated[2 * step:2 * step + 2]]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_by_two_processes_resumes_on_one_and_back(tokenizer, num_workers):
    make = functools.partial(data.MLMLoader, str(REPO / "sample_data"), tokenizer, seq_len=32, max_predictions=5,
                             seed=3, num_workers=num_workers, shuffle_bytes=500)
    straight = batches_of(make(batch_size=4), 12)
    two = [make(batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    for loader in two:
        batches_of(loader, 5)
    states = [torch.load(_saved(loader.state_dict()), weights_only=True) for loader in two]
    one = make(batch_size=2, grad_accum=2)  # 2 processes -> 1 with twice the accumulation
    one.load_state_dict(states)
    rows = batches_of(one, 8)
    assert all(torch.equal(torch.cat([rows[2 * i][k], rows[2 * i + 1][k]]), straight[5 + i][k])
               for i in range(3) for k in straight[0])
    again = [make(batch_size=2, rank=r, world_size=2) for r in (0, 1)]  # and back to 2 at step 9
    for loader in again:
        loader.load_state_dict([one.state_dict()])
    for step in range(9, 12):
        halves = [next(iter(loader)) for loader in again]
        assert all(torch.equal(torch.cat([h[k] for h in halves]), straight[step][k]) for k in straight[0])
    with pytest.raises(data.DataError, match=r"global_batch 4 then, 2 now"):
        make(batch_size=2).load_state_dict(states)
    with pytest.raises(data.DataError, match=r"has no stream 2 \(not every process's state\?\)"):
        one.load_state_dict(states[:1])


def test_a_saved_state_out_of_range_or_of_another_type_is_refused_before_a_batch(tokenizer):
    """The loader's state holds positions in the corpus and row counters: a value of another type, negative, past
    its share of the corpus or past what the stream's rows can have read is refused when loaded, not read on."""
    make = functools.partial(data.MLMLoader, str(REPO / "sample_data"), tokenizer, batch_size=2, seq_len=32,
                             max_predictions=5, num_workers=2, shuffle_bytes=500)
    loader = make()
    batches_of(loader, 5)  # worker 0 has made 3 steps, worker 1 two
    good = loader.state_dict()
    make().load_state_dict(good)
    fields = {name: i for i, name in enumerate(data.READER.names)}  # a reader's columns: a language's fields

    def edited(key, change):
        state = {**good, "streams": {k: v.clone() for k, v in good["streams"].items()}}
        state["streams"][key] = change(state["streams"][key])
        return state

    def at(field, value, stream=0):
        return lambda t: t.index_put_((torch.tensor(stream), torch.tensor(fields[field])), torch.tensor(value))
    damaged = {
        "float row counters": edited("seq", lambda t: t.double()),
        "a reader's fields cut": edited("readers", lambda t: t[:, :-1]),
        "a negative document": edited("readers", at("doc", -1)),
        "a negative pass": edited("readers", at("pass", -2)),
        "a chunk past the share": edited("readers", at("chunk", 10 ** 6)),
        "more passes than rows can read": edited("readers", at("pass", 10 ** 6, stream=3)),
        "a borrow past the streams": edited("readers", at("borrow", 10 ** 3)),
        "a flag that is neither 0 nor 1": edited("readers", at("any", 2)),
        "one stream ahead of its worker's": edited("seq", lambda t: t.index_put_((torch.tensor(1),), torch.tensor(99))),
        "a negative row counter": edited("seq", lambda t: t - 10),
        "a worker that is none": {**good, "next_worker": 2},
        "a worker by name": {**good, "next_worker": "1"},
    }
    for case, state in damaged.items():
        with pytest.raises(data.DataError, match="the saved data-loader state is damaged"):
            make().load_state_dict(state)
            pytest.fail(case)
    # Every row counter 7 rows on: consistent in itself, but not the 5 steps of the checkpoint it was saved with.
    raised = edited("seq", lambda t: t + 7)
    make().load_state_dict(raised)
    make().load_state_dict(good, 5)
    with pytest.raises(data.DataError, match="damaged: its row counters count 19 steps, not the 5 of its checkpoint"):
        make().load_state_dict(raised, 5)


def test_a_saved_state_must_fit_the_data_and_settings_but_not_the_path(tokenizer, tmp_path, monkeypatch):
    relative = data.MLMLoader("sample_data" if Path.cwd() == REPO else str(REPO / "sample_data"), tokenizer,
                              batch_size=2, seq_len=32)
    next(iter(relative))
    moved = tmp_path / "moved"
    moved.mkdir()
    for path in (REPO / "sample_data").glob("*.txt"):
        (moved / path.name).write_bytes(path.read_bytes())
    elsewhere = data.MLMLoader(str(moved), tokenizer, batch_size=2, seq_len=32)  # the same files, another path
    elsewhere.load_state_dict(relative.state_dict())
    other = data.MLMLoader(str(moved), tokenizer, batch_size=2, seq_len=32, seed=1)
    with pytest.raises(data.DataError, match="other data or settings: seed 0 then, 1 now"):
        other.load_state_dict(relative.state_dict())
    (moved / "de.txt").write_text((moved / "de.txt").read_text() + "Noch ein Satz.\n")
    changed = data.MLMLoader(str(moved), tokenizer, batch_size=2, seq_len=32)
    with pytest.raises(data.DataError, match=r"files \(language, name, size, lines, SHA-256\) \['de', 'de.txt', "):
        changed.load_state_dict(relative.state_dict())
    # Edited in place to the same size, but two lines where there was one: the languages' shares have changed.
    state = changed.state_dict()
    text = (moved / "fr.txt").read_text()
    (moved / "fr.txt").write_text(text.replace(" ", "\n", 1))
    with pytest.raises(data.DataError, match=r"the corpus files .* \['fr', 'fr.txt', \d+, \d+, '[0-9a-f]{64}'\] then"):
        data.MLMLoader(str(moved), tokenizer, batch_size=2, seq_len=32).load_state_dict(state)
    # Edited in place to the same size and lines (and, as `cp -p` leaves it, the same modification time).
    state = data.MLMLoader(str(moved), tokenizer, batch_size=2, seq_len=32).state_dict()
    stat = (moved / "fr.txt").stat()
    (moved / "fr.txt").write_text((moved / "fr.txt").read_text().replace("e", "a", 1))
    os.utime(moved / "fr.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(data.DataError, match=r"\['fr', 'fr.txt', \d+, \d+, '[0-9a-f]{64}'\] then"):
        data.MLMLoader(str(moved), tokenizer, batch_size=2, seq_len=32).load_state_dict(state)


def test_an_input_that_is_no_regular_file_is_refused_before_it_is_read(tokenizer, tmp_path):
    """A FIFO would block its reader (in open, with no writer) and a device such as /dev/zero never end: every reader
    of a file the user names refuses them, and a missing file, in one line naming the file (and the flag)."""
    fifo, folder, missing = tmp_path / "de.txt", tmp_path / "corpus", tmp_path / "missing.tsv"
    os.mkfifo(fifo)
    (folder / "fr.txt").mkdir(parents=True)  # a folder named as a corpus file
    readers = {"task file": lambda p: data.read_pairs(p), "tagging": lambda p: data.read_tagging(p),
               "squad": lambda p: data.read_squad(p), "text": data.read_text, "corpus lines": data.count_lines,
               "--data": lambda p: data.MLMLoader(p, tokenizer), "--tokenizer": data.Tokenizer}
    for name, read in readers.items():
        flag = f"{name} " if name.startswith("--") else ""
        for path, said in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"), (missing, "no such file")):
            with pytest.raises(data.DataError, match=f"^{re.escape(flag + str(path))}: {said}"):
                read(str(path))
    with pytest.raises(data.DataError, match=f"^--data {re.escape(str(folder / 'fr.txt'))}: not a regular file"):
        data.MLMLoader(str(folder), tokenizer)


def test_a_corpus_directory_is_read_with_its_folders(tmp_path):
    for path in ("en.txt", "tatoeba/de.txt", "novels/en.botchan.txt"):  # (any other file is refused: below)
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("a line\n")
    found = data.corpus_files(str(tmp_path))
    assert found == {"de": [str(tmp_path / "tatoeba" / "de.txt")],
                     "en": [str(tmp_path / "en.txt"), str(tmp_path / "novels" / "en.botchan.txt")]}


def test_a_corpus_folder_whose_name_holds_glob_characters_is_that_folder(tmp_path):
    """c[1] is a name, not a pattern that reads c1's files instead."""
    for folder, lang in (("c[1]", "en"), ("c1", "de"), ("c*", "fr")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{lang}.txt").write_text("a line\n")
    for folder, lang in (("c[1]", "en"), ("c*", "fr")):
        assert data.corpus_files(str(tmp_path / folder)) == {lang: [str(tmp_path / folder / f"{lang}.txt")]}


def test_lines_and_digests_are_counted_in_parallel_and_checked(tmp_path):
    write_lines(tmp_path / "en.txt", [f"line {i}" for i in range(30)])
    write_lines(tmp_path / "fr.txt", [f"ligne {i}" for i in range(12)] + [""])
    paths = [str(tmp_path / "en.txt"), str(tmp_path / "fr.txt")]
    digests = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]
    assert data.line_counts(paths) == {paths[0]: (30, digests[0]), paths[1]: (12, digests[1])}
    (tmp_path / "de.txt").write_bytes(b"eine Zeile\n\n" * (6 << 20))  # 72 MB: counted by worker processes
    big = [*paths, str(tmp_path / "de.txt")]
    digest = hashlib.sha256((tmp_path / "de.txt").read_bytes()).hexdigest()
    assert data.line_counts(big) == {**data.line_counts(paths), big[2]: (6 << 20, digest)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["de.txt", "en.txt", "fr.txt"]  # nothing beside the corpus
    (tmp_path / "de.txt").unlink()


def test_a_corpus_file_changed_while_it_is_streamed_is_named(tokenizer, tmp_path):
    corpus = tmp_path / "en.txt"
    write_lines(corpus, [f"sentence number {i} of many" for i in range(400)])
    loader = data.MLMLoader(str(corpus), tokenizer, batch_size=2, seq_len=32, shuffle_bytes=256)
    batches = iter(loader)
    next(batches)
    corpus.write_bytes(corpus.read_bytes()[:3000])  # truncated under the running loader
    with pytest.raises(data.DataError, match=r"en.txt: 3000 bytes, \d+ when this run counted its lines: changed"):
        for _ in range(200):
            next(batches)


def test_a_long_line_is_read_in_parts_and_once(tmp_path, monkeypatch):
    corpus = tmp_path / "en.txt"
    corpus.write_text("short\n" + "x" * (2 * data.MAX_LINE + 5) + "\nend\n")
    size = corpus.stat().st_size
    assert data.read_chunk(str(corpus), 0, size, size) == [["short", "x" * data.MAX_LINE, "x" * data.MAX_LINE, "xxxxx",
                                                           "end"]]
    # A range inside the long line holds no line's start: nothing is read past it (a 50 MB line read to its end
    # for each of its ranges was 76 GB a pass).
    (corpus := tmp_path / "de.txt").write_text("a\n" + "x" * 10**6 + "\nb\n")
    read = []

    class Counted(io.FileIO):
        def read(self, n=-1):
            read.append(len(out := super().read(n)))
            return out

    monkeypatch.setattr(data, "open_input", lambda path, named="": Counted(path, "rb"))  # (read_chunk's opener)
    assert data.read_chunk(str(corpus), 1000, 2000, corpus.stat().st_size) == []
    assert 0 < sum(read) <= 1001, read


def test_a_corpus_file_changed_after_counting_is_named_not_decoded_wrongly(tokenizer, tmp_path):
    corpus = tmp_path / "en.txt"
    corpus.write_bytes(b"first line\nsecond line\n")
    assert data.line_counts([str(corpus)])[str(corpus)][0] == 2
    stat = corpus.stat()
    corpus.write_bytes(b"first line\nsecond\xffline\n")  # the same size
    with pytest.raises(data.DataError, match=r"en.txt:2: not UTF-8"):  # counted again at the next start
        data.MLMLoader(str(corpus), tokenizer)
    with pytest.raises(data.DataError, match=r"en.txt: byte 17: not UTF-8"):  # what a running loader reads
        data.read_chunk(str(corpus), 0, stat.st_size, stat.st_size)


def test_bad_corpus_files_are_named(tokenizer, tmp_path):
    good = tmp_path / "en.txt"
    good.write_text("a line\n")
    cases = {
        "fr.txt": (None, r"fr.txt: no such file"),
        "de.txt": (b"", r"de.txt: empty file"),
        "es.txt": (b"\n  \n\n", r"es.txt: only blank lines"),
        "ru.txt": ("первая строка\n\nвторая\n".encode() + b"caf\xe9\n", r"ru.txt:4: not UTF-8"),
        "bin.txt": (b"text\n" + b"\0" * 4096, r"bin.txt:2: a NUL byte: not a text file"),
        "el.txt.gz": (b"\x1f\x8b\x08\x00", r"el.txt.gz: a compressed file"),
        "xquad.de.json": (b'{"data": []}\n', r"xquad.de.json: a JSON file; a corpus is plain text"),
        "mac.txt": (b"one\ntwo\rthree\r", r"mac.txt:2: lines that end in a carriage return alone"),  # old Mac OS
    }
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises((data.DataError, FileNotFoundError), match=message):
            data.MLMLoader([str(good), str(tmp_path / name)], tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match=r"empty: no \*.txt files"):
        data.MLMLoader(str(tmp_path / "empty"), tokenizer)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "en.txt").write_text("a line\n")
    (tmp_path / "packed" / "fr.txt.gz").write_bytes(b"\x1f\x8b\x08\x00")  # in a directory too: not left out
    with pytest.raises(data.DataError, match=r"fr.txt.gz: a compressed file"):
        data.MLMLoader(str(tmp_path / "packed"), tokenizer)
    (tmp_path / "empty" / "de.txt").mkdir()
    with pytest.raises(data.DataError, match=r"de.txt: not a regular file \(a directory"):
        data.MLMLoader(str(tmp_path / "empty"), tokenizer)
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".fr.txt").write_text("une ligne\n")  # no language before the first dot
    with pytest.raises(data.DataError, match=r".fr.txt: a corpus file's language is its name up to the first dot"):
        data.MLMLoader(str(tmp_path / "hidden"), tokenizer)
    with pytest.raises(TypeError, match=r"not a dict"):  # {language: files} is not a form: the name says it
        data.MLMLoader({"en": [str(good)]}, tokenizer)


def test_a_corpus_folder_reads_every_file_or_names_those_it_cannot(tmp_path):
    """XQuAD's folder as --data: its JSON files and licence text named, not skipped (the licence was read as a
    language "LICENSE-CC-BY-SA-4"); a folder of language-named text files reads every one."""
    xquad = tmp_path / "xquad"
    xquad.mkdir()
    for name in ("LICENSE-CC-BY-SA-4.0.txt", "xquad.de.json", "xquad.en.json"):
        (xquad / name).write_text("text\n")
    message = r"xquad: LICENSE-CC-BY-SA-4.0.txt, xquad.de.json, xquad.en.json: a corpus file's language is its name"
    with pytest.raises(data.DataError, match=message):
        data.corpus_files(str(xquad))
    (tmp_path / "corpus" / "wiki").mkdir(parents=True)
    for name in ("en.txt", "de.2.txt", "wiki/zh-Hant.txt", "wiki/README"):
        (tmp_path / "corpus" / name).write_text("text\n")
    with pytest.raises(data.DataError, match=r"corpus: wiki/README: a corpus file's language"):
        data.corpus_files(str(tmp_path / "corpus"))
    (tmp_path / "corpus" / "wiki" / "README").unlink()
    assert {lang: len(paths) for lang, paths in data.corpus_files(str(tmp_path / "corpus")).items()} == {
        "de": 1, "en": 1, "zh-Hant": 1}
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf\nline\n")  # a byte order mark on a blank first line
    assert data.count_lines(str(tmp_path / "bom.txt"))[0] == 1
    (tmp_path / "stray.txt").write_bytes(b"one\r\ntw\ro\r\r\nthree")  # a stray carriage return is a blank
    assert data.count_lines(str(tmp_path / "stray.txt"))[0] == 3


def test_a_corpus_sentencepiece_cannot_read_is_named(tmp_path):
    (tmp_path / "en.txt").write_text("\u200b\n\u200b\u200b\n")  # text to Python, blank after NFKC
    with pytest.raises(data.DataError, match="en.txt.*SentencePiece could not train a tokenizer on it"):
        data.train_tokenizer(str(tmp_path / "en.txt"), 400, str(tmp_path / "spm"))


def test_a_corpus_gives_one_tokenizer_whatever_the_machine(tmp_path, monkeypatch):
    """One file, byte for byte: a checkpoint records its tokenizer's SHA-256, and refuses another. SentencePiece's
    trainer sums its EM statistics per thread (another thread count, other pieces), and its files record the paths
    it read and wrote (here temporary: another file at every training)."""
    models = []
    for cores in (2, 16):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        models.append(Path(data.train_tokenizer(str(REPO / "sample_data"), 1000, str(tmp_path / f"spm{cores}")))
                      .read_bytes())
    assert models[0] == models[1]
    assert (tmp_path / "spm2.vocab").read_text().splitlines()[:2] == ["[PAD]\t0", "[UNK]\t0"]  # beside it, as ever


def test_a_ctrl_c_while_the_tokenizer_trains_stays_a_ctrl_c(tmp_path, monkeypatch):
    """Python raises a Ctrl-C's KeyboardInterrupt at the next Python code it runs. Read from a generator of ours, the
    sample ran Python code inside SentencePiece's trainer, which made a Ctrl-C there its own error, reported as a
    corpus it could not train on. Here a trace hook raises where that Python code would run."""
    class Interrupted(Exception):  # (a KeyboardInterrupt would stop pytest)
        pass
    train = data.spm.SentencePieceTrainer.train

    def train_interrupted_in_our_code(**kwargs):
        def hook(frame, event, arg):
            if frame.f_code.co_filename == data.__file__:
                raise Interrupted
        sys.settrace(hook)
        try:
            return train(**kwargs)
        finally:
            sys.settrace(None)
    monkeypatch.setattr(data.spm.SentencePieceTrainer, "train", train_interrupted_in_our_code)
    assert data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 1000, str(tmp_path / "spm"))).vocab_size


def test_lines_longer_than_sentencepiece_reads_still_train_the_tokenizer(tmp_path):
    # A document per line, past SentencePiece's 64 KiB: it would skip the line, and Greek get no pieces.
    greek = ["Αν έχεις να πεις κάτι, πες το.", "Το σπίτι είναι μεγάλο και όμορφο."] * 2000
    (tmp_path / "el.txt").write_text(" ".join(greek) + "\n")
    (tmp_path / "en.txt").write_text("A short English line.\n" * 50)
    tokenizer = data.Tokenizer(data.train_tokenizer(str(tmp_path), 400, str(tmp_path / "spm")))
    assert not any(tokenizer.sp.is_byte(i) for i in tokenizer.encode("Αν έχεις να πεις κάτι"))


# ----------------------------------------------------------------------------------------------
# XTREME tasks

@needs_shared
def test_every_shared_classification_and_tagging_file_reads():
    pairs = sorted((SHARED / "xnli").glob("**/*.tsv")) + sorted((SHARED / "pawsx").glob("**/*.tsv"))
    for path in pairs:
        labels = CLASSIFICATION_LABELS["xnli"] if "xnli" in str(path) else CLASSIFICATION_LABELS["pawsx"]
        examples = data.read_pairs(str(path), labels, labelled=True)
        assert examples and all(e.label in labels for e in examples), path
        if path.parent.name in ("xnli", "pawsx"):
            assert len(examples) == (1002 if path.parent.name == "xnli" else 1000), path
    # XNLI 1.0's own files: one row per language, the language from its column.
    original = data.read_pairs(str(SHARED / "xnli/original_format_samples/XNLI-1.0/xnli.dev.tsv"), labelled=True)
    assert len({e.language for e in original}) == 15 and original[0].language == "ar"
    # csv rules: a quoted field loses its quotes and its doubled quotes become one.
    fr = data.read_pairs(str(SHARED / "pawsx" / "dev-fr.tsv"))
    assert not any(e.sentence1.startswith('"') and e.sentence1.endswith('"') for e in fr)
    assert any('"' in e.sentence1 for e in fr)
    ko = data.read_pairs(str(SHARED / "pawsx" / "dev-ko.tsv"))  # U+001C inside line 824 is not a line break
    assert "\x1c" in ko[823].sentence1 + ko[823].sentence2
    tagged = sorted(p for p in (SHARED / "ner").glob("**/*-*") if p.is_file())
    for path in tagged:
        examples = data.read_tagging(str(path), TAGGING_LABELS["panx"], labelled=True)
        assert examples and all(len(e.tokens) == len(e.labels) for e in examples), path
        assert not any(re.match(r"[a-z]{2}:", t) for e in examples for t in e.tokens), path  # prefix removed
    assert len(data.read_tagging(str(SHARED / "ner" / "panx" / "train-en.tsv"))) == 1000
    assert len(tagged) > 150


SQUAD = {"data": [{"title": "t", "paragraphs": [{"context": "The tower is in Paris.", "qas": [
    {"id": "q1", "question": "Where?", "answers": [{"answer_start": 16, "text": "Paris"}]}]}]}]}


def squad_with(**changes):
    """SQUAD with its question's fields (or the paragraph's, for "paragraphs") replaced."""
    squad = json.loads(json.dumps(SQUAD))
    if "paragraphs" in changes:
        squad["data"][0]["paragraphs"] = changes.pop("paragraphs")
    else:
        squad["data"][0]["paragraphs"][0]["qas"][0].update(changes)
    return json.dumps(squad)


@pytest.mark.parametrize("name, text, reader, message", [
    ("dev-en.tsv", "a\tb\tentailment\nc\td\n", "pairs", r"dev-en.tsv:2: 2 tab-separated fields; expected 3"),
    ("dev-en.tsv", "a\tb\nc\td\tneutral\n", "pairs", r"dev-en.tsv:1: 2 tab-separated fields; expected 3"),
    ("dev-en.tsv", "a\tb\tentailment\nc\td\tmaybe\n", "pairs", r"dev-en.tsv:2: unknown label 'maybe'"),
    ("dev-en.tsv", "a\tb\n", "labelled pairs", r"dev-en.tsv:1: 2 tab-separated fields; expected 3: sentence1"),
    ("dev-en.tsv", "id\tsentence1\tsentence2\n1\ta\tb\n", "labelled pairs", r"dev-en.tsv:1: a header without"),
    ("dev-en.tsv", "a\tb\tentailment\n" * 6 + 'c\t"d\tneutral\n' + "e\tf\tneutral\n" * 3, "pairs",
     r"dev-en.tsv:7: .* \(a quote never closed\?\)"),
    ("dev-de.tsv", "Berlin\tB-LOC\n\nist\tO\nschön\tB-ADJ\n", "tagging", r"dev-de.tsv:4: unknown label 'B-ADJ'"),
    ("dev-de.tsv", "Berlin\tB-LOC\tx\n", "tagging", r"dev-de.tsv:1: 3 tab-separated fields"),
    ("dev-de.tsv", "Berlin B-LOC\n", "labelled tagging", r"dev-de.tsv:1: 1 tab-separated fields; expected token<TAB>"),
    ("dev-de.tsv", "Berlin\nist\tO\n", "tagging", r"dev-de.tsv:1: 1 tab-separated fields; expected token<TAB>label"),
    ("dev-de.tsv", "Berlin\tB-LOC\n\tO\n", "tagging", r"dev-de.tsv:2: an empty token; expected token<TAB>label"),
    ("dev-de.tsv", b"Berlin\tB-LOC\n\nK\xf6ln\tB-LOC\n", "tagging", r"dev-de.tsv:3: not UTF-8"),
    # PAN-X's tokens never hold a space: a JSON or space-separated file is not read one line per "token".
    ("x.json", '{\n  "data": [\n', "panx tokens", r"x.json:2: the token '  \"data\": \[' holds a space"),
    ("dev-de.tsv", "Berlin B-LOC\nist O\n", "panx tokens", r"dev-de.tsv:1: the token 'Berlin B-LOC' holds a space"),
    ("x.json", squad_with(answers=[{"answer_start": 15, "text": "Paris"}]), "squad",
     r"x.json: question 'q1': answer 'Paris' is not at answer_start 15"),
    ("x.json", squad_with(answers=[{"answer_start": "16", "text": "Paris"}]), "squad", r"x.json: question 'q1': needs"),
    ("x.json", squad_with(answers=[{"answer_start": -1, "text": ""}]), "squad", r"x.json: question 'q1': needs"),
    ("x.json", squad_with(id=7), "squad", r"x.json: data\[0\].paragraphs\[0\].qas\[0\]: needs a \"id\" string"),
    ("x.json", squad_with(paragraphs={"context": "x"}), "squad", r"x.json: data\[0\]: needs a \"paragraphs\" list"),
    ("x.json", json.dumps({"data": [{"paragraphs": [{"context": "ab", "qas": [
        {"id": "q", "question": "?", "answers": []}] * 2}]}]}), "squad", r"x.json: question 'q': this id is used twice"),
    # JSON's \ud83d escape alone (half of a cut-off emoji) is no character: no tokenizer can read it.
    ("x.json", squad_with(question="Where\ud83d?"), "squad", r"x.json: question 'q1': .* a lone UTF-16 surrogate"),
    pytest.param("x.json", "[" * 100_000 + "]" * 100_000, "squad", r"x.json: not SQuAD-format JSON",
                 id="JSON nested deeper than Python's recursion limit"),
    pytest.param("x.json", '{"data": ' + "9" * 5000 + "}", "squad", r"x.json: not SQuAD-format JSON .*5000 digits",
                 id="an integer Python does not convert"),
    ("x.json", b'{"data": "\xff"}', "squad", r"x.json:1: not UTF-8 \(byte 0xff\)$"),  # (said once, not wrapped)
    ("p.tsv", "A man.\t \tentailment\n", "pairs", r"p.tsv:1: a blank sentence2; a pair needs two sentences"),
    ("p.tsv", "premise\thypo\tlabel\n\tA man.\tneutral\n", "pairs", r"p.tsv:2: a blank sentence1"),
    # Old Mac line endings: the file would be one sentence of one token, "Anton\rWilhelm\r...".
    ("dev-de.tsv", "Anton\rWilhelm\r\rBerlin\r", "tagging", r"dev-de.tsv:1: a carriage return without a line feed"),
])
def test_task_input_errors_name_the_file_and_line(tmp_path, name, text, reader, message):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    read = {"pairs": lambda: data.read_pairs(str(path), CLASSIFICATION_LABELS["xnli"]),
            "labelled pairs": lambda: data.read_pairs(str(path), labelled=True),
            "tagging": lambda: data.read_tagging(str(path), TAGGING_LABELS["panx"]),
            "labelled tagging": lambda: data.read_tagging(str(path), labelled=True),
            "panx tokens": lambda: data.read_tagging(str(path), TAGGING_LABELS["panx"], spaces=False),
            "squad": lambda: data.read_squad(str(path))}[reader]
    with pytest.raises(data.DataError, match=message):
        read()


def test_a_header_without_labels_is_a_header(tmp_path):
    # Unlabelled pairs for `predict`, with the releases' column names: the header is no example.
    for text in ("premise\thypo\nA man.\tA person.\n", "id\tsentence1\tsentence2\n7\tA man.\tA person.\n"):
        (tmp_path / "p.tsv").write_text(text)
        assert [(e.sentence1, e.sentence2, e.label) for e in data.read_pairs(str(tmp_path / "p.tsv"))] == [
            ("A man.", "A person.", None)]


def test_a_token_that_str_strip_removes_is_a_token_not_a_sentence_break(tmp_path):
    (tmp_path / "t.tsv").write_text("Berlin\n\u00a0\nist\n\n\u3000\n")  # no-break space, ideographic space
    assert [e.tokens for e in data.read_tagging(str(tmp_path / "t.tsv"))] == [["Berlin", "\u00a0", "ist"], ["\u3000"]]


def test_crlf_and_a_byte_order_mark_are_read_alike(tmp_path):
    for name, text in (("p.tsv", "a\tb\tentailment\nc\td\tneutral\n"), ("t.tsv", "Berlin\tB-LOC\n\nist\tO\n"),
                       ("s.json", json.dumps(SQUAD, indent=1))):
        (tmp_path / name).write_text(text)
        (tmp_path / ("bom-" + name)).write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    for name, read in (("p.tsv", data.read_pairs), ("t.tsv", data.read_tagging), ("s.json", data.read_squad)):
        plain, windows = read(str(tmp_path / name)), read(str(tmp_path / ("bom-" + name)))
        assert [{k: v for k, v in vars(e).items() if k != "source"} for e in plain] == \
               [{k: v for k, v in vars(e).items() if k != "source"} for e in windows]
