"""Tests for data.py: the tokenizer (special pieces, offsets into the original text), the masked-LM stream
(masking statistics, alpha sampling, sharding, exact resume, bad input) and the XTREME task formats (every
shared file reads; QA answers survive features -> gold positions -> decoding)."""

import gzip
import itertools
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

import data
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


def rows(batch, tokenizer):
    """Original pieces of the non-padding rows, without [CLS], [SEP] and padding."""
    out = []
    for row, mask in zip(restore(batch), batch["attention_mask"]):
        if mask[0]:
            out.append(row[1:int(mask.sum()) - 1].tolist())
    return out


# ----------------------------------------------------------------------------------------------
# Tokenizer

def test_tokenizer_special_pieces_and_offsets_into_the_original_text(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id) == (0, 1, 2, 3, 4)
    assert tokenizer.vocab_size == 1000
    assert tokenizer.encode("[MASK]") != [tokenizer.mask_id]  # a control symbol: text never becomes one
    # NFKC (full-width letters, the "ﬁ" ligature, an ideographic space) and collapsed whitespace.
    text = "  Ｔｈｅ  harbour\u3000town ﬁne, 港口小镇 «Марта»!"
    ids, offsets = tokenizer.encode_with_offsets(text)
    assert ids == tokenizer.encode(text) and len(offsets) == len(ids)
    previous_end = 0
    for (start, end), piece in zip(offsets, ids):
        assert previous_end <= start <= end <= len(text)
        assert text[start:end].strip() == text[start:end]  # no whitespace inside a span's ends
        previous_end = end
    words = [text[s:e] for (s, e), i in zip(offsets, ids) if s < e]
    assert "".join(words) == "".join(text.split())  # every visible character once, in order
    assert text[offsets[0][0]:offsets[2][1]].startswith("Ｔｈ")  # the original full-width text, not "Th"
    assert tokenizer.decode(tokenizer.encode("the harbour town")) == "the harbour town"


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


def test_tokenizer_command_line_and_small_vocabularies(tmp_path):
    out = subprocess.run([sys.executable, "data.py", "tokenizer", "--input", "sample_data", "--vocab-size", "400",
                          "--out", str(tmp_path / "cli")], cwd=REPO, capture_output=True, text=True, check=True)
    assert "400 pieces from 10 files in 10 languages" in out.stdout
    # 8000 asked of the small sample corpus: the largest vocabulary it holds (a soft limit).
    assert 3000 < data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 8000, str(tmp_path / "big"))).vocab_size < 8000


def test_sampling_probabilities_follow_the_formula():
    p = data.sampling_probabilities({"en": 400, "de": 100, "sw": 25}, alpha=0.5)
    assert p == pytest.approx({"en": 20 / 35, "de": 10 / 35, "sw": 5 / 35})
    assert data.sampling_probabilities({"en": 400, "de": 100}, alpha=1.0) == pytest.approx({"en": 0.8, "de": 0.2})


# ----------------------------------------------------------------------------------------------
# Masked-LM stream

def test_masking_statistics_fixed_shapes_and_no_special_token_masked(tokenizer):
    loader = data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=8, seq_len=64, max_predictions=12, seed=1)
    counts = Counter()
    expected_masked = 0
    for batch in itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), 150):
        assert {k: tuple(v.shape) for k, v in batch.items()} == {
            "input_ids": (8, 64), "token_type_ids": (8, 64), "attention_mask": (8, 64),
            "masked_positions": (8, 12), "masked_ids": (8, 12), "masked_weights": (8, 12)}
        assert batch["masked_weights"].dtype == torch.float32 and batch["input_ids"].dtype == torch.long
        original = restore(batch)
        for b in range(8):
            length = int(batch["attention_mask"][b].sum())
            if length == 0:
                assert not batch["masked_weights"][b].any()
                continue
            assert batch["attention_mask"][b, :length].all() and original[b, 0] == tokenizer.cls_id
            assert original[b, length - 1] == tokenizer.sep_id
            n = int(batch["masked_weights"][b].sum())
            assert batch["masked_weights"][b].tolist() == [1.0] * n + [0.0] * (12 - n)
            expected_masked += min(12, max(1, round(length * 0.15)))  # create_pretraining_data.py's count
            positions = batch["masked_positions"][b, :n]
            assert positions.tolist() == sorted(set(positions.tolist()))
            assert ((positions > 0) & (positions < length - 1)).all()  # never [CLS] or [SEP]
            masked_ids = batch["masked_ids"][b, :n]
            assert not set(masked_ids.tolist()) & {tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id}
            now = batch["input_ids"][b, positions]
            counts["mask"] += int((now == tokenizer.mask_id).sum())
            counts["same"] += int((now == masked_ids).sum())
            counts["random"] += int(((now != tokenizer.mask_id) & (now != masked_ids)).sum())
            counts["tokens"] += length
    total = counts["mask"] + counts["same"] + counts["random"]
    assert total == expected_masked and total > 5000
    assert total / counts["tokens"] == pytest.approx(0.15, abs=0.01)
    assert counts["mask"] / total == pytest.approx(0.8, abs=0.02)
    assert counts["same"] / total == pytest.approx(0.1, abs=0.015)  # a random piece can be the same piece
    assert counts["random"] / total == pytest.approx(0.1, abs=0.015)


def test_whole_word_masking_masks_every_piece_of_a_word(tokenizer):
    loader = data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=8, seq_len=64, max_predictions=12,
                            seed=2, whole_word_masking=True)
    multi_piece = 0
    for batch in itertools.islice(loader, 30):
        original = restore(batch)
        for b in range(8):
            length = int(batch["attention_mask"][b].sum())
            masked = set(batch["masked_positions"][b][batch["masked_weights"][b] > 0].tolist())
            for i in masked:
                if not tokenizer.word_start[original[b, i]]:  # a continuation: its word start is masked
                    assert i - 1 in masked or i == 1
                if i + 1 < length - 1 and not tokenizer.word_start[original[b, i + 1]]:
                    assert i + 1 in masked
                    multi_piece += 1
    assert multi_piece > 100


def write_lines(path, lines, per_document=5):
    """Lines with a blank line after every `per_document` (plain or .gz by the name)."""
    text = "".join(line + "\n" + ("\n" if (i + 1) % per_document == 0 else "") for i, line in enumerate(lines))
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(text)


def test_languages_are_drawn_with_alpha_smoothed_frequencies(tokenizer, tmp_path):
    sample = {lang: (REPO / "sample_data" / f"{lang}.txt").read_text().split("\n") for lang in ("en", "ru", "el")}
    sizes = {"en": 400, "ru": 100, "el": 25}
    for lang, n in sizes.items():
        lines = [line for line in sample[lang] if line]
        write_lines(tmp_path / f"{lang}.txt", [lines[i % len(lines)] for i in range(n)])
    loader = data.MLMLoader(str(tmp_path), tokenizer, batch_size=4, seq_len=24, max_predictions=4, seed=3)
    assert loader.probabilities == pytest.approx(data.sampling_probabilities(sizes, 0.5))
    scripts = Counter()
    for batch in itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), 400):
        for row in rows(batch, tokenizer):
            text = tokenizer.decode(row)
            scripts["ru" if re.search("[а-я]", text) else "el" if re.search("[α-ω]", text) else "en"] += 1
    n = sum(scripts.values())
    for lang, p in loader.probabilities.items():  # 20 : 10 : 5, within 4 standard deviations
        assert scripts[lang] / n == pytest.approx(p, abs=4 * (p * (1 - p) / n) ** 0.5), scripts


def letters(i):
    """A number written with the letters a-j (the sample corpus has no digits)."""
    return "".join("abcdefghij"[int(d)] for d in f"{i:05d}")


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """One language in a plain and a gzip file, every line numbered in letters: Naaaaa ... Nadgj."""
    root = tmp_path_factory.mktemp("numbered")
    words = "the harbour town wakes up slowly on winter mornings".split()
    lines = [f"N{letters(i)} " + " ".join(words[:1 + i % len(words)]) for i in range(360)]
    write_lines(root / "en.txt", lines[:200])
    write_lines(root / "en.1.txt.gz", lines[200:], per_document=7)
    return root


def test_ranks_and_workers_read_disjoint_shares_covering_every_line_once(tokenizer, numbered):
    seen = Counter()
    for rank in range(2):
        loader = data.MLMLoader(str(numbered), tokenizer, batch_size=2, seq_len=24, max_predictions=4, seed=4,
                                rank=rank, world_size=2, num_workers=2, shuffle_bytes=512)
        streams = {}  # (worker, row) -> its pieces in order: lines continue from one row to the next
        for batch in loader:
            worker = (loader.state_dict()["next_worker"] - 1) % 2  # the worker that made this batch
            for b, row in enumerate(restore(batch)):
                streams.setdefault((worker, b), []).extend(row[1:int(batch["attention_mask"][b].sum()) - 1].tolist())
        assert len(streams) == 4
        for pieces in streams.values():
            seen.update(re.findall(r"N([a-j]{5})", tokenizer.decode(pieces)))
    assert sorted(seen) == [letters(i) for i in range(360)] and set(seen.values()) == {1}


def test_documents_by_byte_range_partition_a_file(tmp_path):
    path = tmp_path / "de.txt"
    write_lines(path, [f"Satz {i}" for i in range(100)], per_document=4)
    size = path.stat().st_size
    for parts in (1, 3, 7, 50):
        bounds = [size * k // parts for k in range(parts + 1)]
        lines = [line for a, b in zip(bounds, bounds[1:]) for doc in data.read_chunk(str(path), a, b) for line in doc]
        assert lines == [f"Satz {i}" for i in range(100)]


def batches_of(loader, n):
    return list(itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_loader_yields_exactly_the_uninterrupted_batches(tokenizer, numbered, num_workers):
    def make():
        return data.MLMLoader([str(numbered), str(REPO / "sample_data" / "ru.txt")], tokenizer, batch_size=3,
                              seq_len=32, max_predictions=5, seed=5, num_workers=num_workers, shuffle_bytes=700)
    straight = batches_of(make(), 70)  # more than one epoch
    assert make().state_dict()["epoch"] == 0
    for stop in (1, 25, 61):
        first = make()
        head = batches_of(first, stop)
        state = torch.load(_saved(first.state_dict()), weights_only=True)  # as a checkpoint holds it
        resumed = make()
        resumed.load_state_dict(state)
        for a, b in zip(head + batches_of(resumed, 70 - stop), straight, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_infinite_loader_never_pads_and_resumes_exactly(tokenizer):
    def make():
        return data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=8, seq_len=32, max_predictions=5,
                              seed=7, infinite=True)
    straight = list(itertools.islice(make(), 120))  # several passes over every share
    assert all(b["attention_mask"][:, 0].all() for b in straight)
    first = make()
    head = list(itertools.islice(first, 50))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(head + list(itertools.islice(resumed, 70)), straight, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _saved(obj):
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_global_batch_does_not_depend_on_the_number_of_ranks(tokenizer):
    one = data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=4, seq_len=32, max_predictions=5, seed=6)
    two = [data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=2, seq_len=32, max_predictions=5, seed=6,
                          rank=r, world_size=2) for r in (0, 1)]
    for whole, *halves in itertools.islice(zip(one, *two), 20):
        for k in whole:
            assert torch.equal(whole[k], torch.cat([h[k] for h in halves]))


def test_a_state_from_other_settings_is_refused(tokenizer):
    state = data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=2, seq_len=32).state_dict()
    other = data.MLMLoader(str(REPO / "sample_data"), tokenizer, batch_size=2, seq_len=32, seed=1)
    with pytest.raises(ValueError, match="saved for other data or settings"):
        other.load_state_dict(state)


def test_bad_corpus_files_are_named(tokenizer, tmp_path):
    good = tmp_path / "en.txt"
    good.write_text("a line\n")
    with pytest.raises(FileNotFoundError, match="fr.txt: no such file"):
        data.MLMLoader([str(good), str(tmp_path / "fr.txt")], tokenizer)
    (tmp_path / "de.txt").write_bytes(b"")
    with pytest.raises(data.DataError, match="de.txt: empty file"):
        data.MLMLoader([str(good), str(tmp_path / "de.txt")], tokenizer)
    (tmp_path / "es.txt").write_text("\n  \n\n")
    with pytest.raises(data.DataError, match="es.txt: only blank lines"):
        data.MLMLoader([str(good), str(tmp_path / "es.txt")], tokenizer)
    (tmp_path / "ru.txt").write_bytes("первая строка\n\nвторая\n".encode() + b"caf\xe9\n")
    with pytest.raises(data.DataError, match=r"ru.txt:4: not UTF-8 \(byte 0xe9\)"):
        data.MLMLoader([str(good), str(tmp_path / "ru.txt")], tokenizer)
    with gzip.open(tmp_path / "el.txt.gz", "wb") as f:
        f.write(b"ok\n\xff\n")
    with pytest.raises(data.DataError, match=r"el.txt.gz:2: not UTF-8"):
        data.train_tokenizer([str(tmp_path / "el.txt.gz")], 100, str(tmp_path / "x"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match=r"empty: no \*.txt or \*.txt.gz files"):
        data.MLMLoader(str(tmp_path / "empty"), tokenizer)


# ----------------------------------------------------------------------------------------------
# XTREME tasks

@needs_shared
def test_every_shared_classification_and_tagging_file_reads():
    pairs = sorted((SHARED / "xnli").glob("**/*.tsv")) + sorted((SHARED / "pawsx").glob("**/*.tsv"))
    for path in pairs:
        labels = CLASSIFICATION_LABELS["xnli"] if "xnli" in str(path) else CLASSIFICATION_LABELS["pawsx"]
        examples = data.read_pairs(str(path), labels)
        assert examples and all(e.label in labels for e in examples), path
        if path.parent.name in ("xnli", "pawsx"):
            assert len(examples) == (1002 if path.parent.name == "xnli" else 1000), path
    # csv rules: a quoted field loses its quotes and its doubled quotes become one.
    fr = data.read_pairs(str(SHARED / "pawsx" / "dev-fr.tsv"))
    assert not any(e.sentence1.startswith('"') and e.sentence1.endswith('"') for e in fr)
    assert any('"' in e.sentence1 for e in fr)
    ko = data.read_pairs(str(SHARED / "pawsx" / "dev-ko.tsv"))  # U+001C inside line 824 is not a line break
    assert "\x1c" in ko[823].sentence1 + ko[823].sentence2
    tagged = sorted((SHARED / "ner").glob("**/*-*"))
    for path in tagged:
        examples = data.read_tagging(str(path), TAGGING_LABELS["panx"])
        assert examples and all(len(e.tokens) == len(e.labels) for e in examples), path
        assert not any(re.match(r"[a-z]{2}:", t) for e in examples for t in e.tokens), path  # prefix removed
    assert len(data.read_tagging(str(SHARED / "ner" / "panx" / "train-en.tsv"))) == 1000
    assert len(tagged) > 150


def test_task_input_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "dev-en.tsv"
    bad.write_text("a\tb\tentailment\nc\td\n")
    with pytest.raises(data.DataError, match=r"dev-en.tsv:2: 2 tab-separated fields, the first line has 3"):
        data.read_pairs(str(bad))
    bad.write_text("a\tb\tentailment\nc\td\tmaybe\n")
    with pytest.raises(data.DataError, match=r"dev-en.tsv:2: unknown label 'maybe'"):
        data.read_pairs(str(bad), CLASSIFICATION_LABELS["xnli"])
    tags = tmp_path / "dev-de.tsv"
    tags.write_text("Berlin\tB-LOC\n\nist\tO\nschön\tB-ADJ\n")
    with pytest.raises(data.DataError, match=r"dev-de.tsv:4: unknown label 'B-ADJ'"):
        data.read_tagging(str(tags), TAGGING_LABELS["panx"])
    tags.write_text("Berlin\tB-LOC\tx\n")
    with pytest.raises(data.DataError, match=r"dev-de.tsv:1: 3 tab-separated fields"):
        data.read_tagging(str(tags))
    tags.write_bytes(b"Berlin\tB-LOC\n\nK\xf6ln\tB-LOC\n")
    with pytest.raises(data.DataError, match=r"dev-de.tsv:3: not UTF-8"):
        data.read_tagging(str(tags))
    squad = tmp_path / "xquad.en.json"
    squad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "The tower is in Paris.", "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"answer_start": 15, "text": "Paris"}]}]}]}]}))
    with pytest.raises(data.DataError, match=r"xquad.en.json: question 'q1': answer 'Paris' is not at answer_start 15"):
        data.read_squad(str(squad))


def test_pair_and_tagging_features(tokenizer, tmp_path):
    path = tmp_path / "dev-en.tsv"
    path.write_text('The harbour town wakes up.\t"The ""town"" sleeps."\tcontradiction\nA\tB\tneutral\n')
    examples = data.read_pairs(str(path), CLASSIFICATION_LABELS["xnli"])
    assert examples[0].sentence2 == 'The "town" sleeps.'
    t = data.pair_features(tokenizer, examples, CLASSIFICATION_LABELS["xnli"], seq_len=12)
    assert t["labels"].tolist() == [0, 2] and t["input_ids"].shape == (2, 12)
    first = t["input_ids"][0].tolist()
    assert first[0] == tokenizer.cls_id and first.count(tokenizer.sep_id) == 2 and first[-1] == tokenizer.sep_id
    assert t["token_type_ids"][0].tolist() == [0] * (first.index(tokenizer.sep_id) + 1) + [1] * (11 - first.index(tokenizer.sep_id))
    tags = tmp_path / "en-dev"
    tags.write_text("en:Marta\tB-PER\nen:visited\tO\nen:Köln\tB-LOC\nen:today\tO\n\nen:Die\tO\n")
    examples = data.read_tagging(str(tags), TAGGING_LABELS["panx"])
    assert examples[0].tokens == ["Marta", "visited", "Köln", "today"]
    t = data.tagging_features(tokenizer, examples, TAGGING_LABELS["panx"], seq_len=16)
    gold = t["labels"].clone()
    assert (gold[:, 0] == -100).all() and sorted(gold[0][gold[0] != -100].tolist()) == [0, 0, 1, 5]
    assert data.tagging_predictions(examples, t, gold.clamp(min=0), TAGGING_LABELS["panx"]) == [e.labels for e in examples]
    with pytest.warns(UserWarning, match=r"\d words did not fit in 6 pieces"):
        t = data.tagging_features(tokenizer, examples[:1], TAGGING_LABELS["panx"], seq_len=6)
    predicted = data.tagging_predictions(examples[:1], t, t["labels"].clamp(min=0), TAGGING_LABELS["panx"])
    assert predicted == [["B-PER", "O", "O", "O"]]  # the cut words get labels[0]


@needs_shared
def test_panx_word_labels_survive_features_and_predictions(tokenizer):
    examples = data.read_tagging(str(SHARED / "ner" / "panx" / "dev-ru.tsv"), TAGGING_LABELS["panx"])
    t = data.tagging_features(tokenizer, examples, TAGGING_LABELS["panx"], seq_len=128)
    assert data.tagging_predictions(examples, t, t["labels"].clamp(min=0), TAGGING_LABELS["panx"]) == [e.labels for e in examples]


def test_span_decoding_follows_max_context_n_best_and_max_answer_length(tokenizer):
    context = " ".join(f"w{letters(i)[-2:]}" for i in range(60))  # wda is word 30
    example = data.SquadExample("q", "which word?", context, [{"text": "wda", "answer_start": context.index("wda")}],
                                0, "test")
    t, meta = data.squad_features(tokenizer, [example], seq_len=40, doc_stride=10, max_query_length=8, training=True)
    assert len(meta) > 2 and t["input_ids"].shape[1] == 40
    answer_start = context.index("wda")
    windows = [m for m in meta if any(o and o[0] == answer_start for o in m["offsets"])]
    assert len(windows) >= 2  # the answer is in several windows; it counts in one only
    n = len(meta)

    def answer(cells, max_answer_length=30):
        start, end = torch.full((n, 40), -10.0), torch.full((n, 40), -10.0)
        for (f, s, e), value in cells:
            start[f, s], end[f, e] = value, value
        return data.decode_spans([example], meta, start, end, n_best=5, max_answer_length=max_answer_length)["q"]

    def last_piece(f, word):
        return next(k for k, o in enumerate(meta[f]["offsets"]) if o and o[1] == context.index(word) + len(word))

    # The gold positions decode to the gold text.
    gold = [f for f in range(n) if t["start_positions"][f] > 0]
    best = [f for f in gold if meta[f]["max_context"][t["start_positions"][f]]]
    assert len(best) == 1
    f = best[0]
    assert answer([((f, int(t["start_positions"][f]), int(t["end_positions"][f])), 5.0)]) == "wda"
    other = next(g for g in gold if g != f)
    # The same span where it has less context is passed over (for the best of the low-scored rest).
    assert answer([((other, int(t["start_positions"][other]), int(t["end_positions"][other])), 5.0)]) != "wda"
    # Longer than max_answer_length: not an answer.
    s, e = int(t["start_positions"][f]), last_piece(f, "wdc")
    assert answer([((f, s, e), 5.0)]) == "wda wdb wdc"
    assert answer([((f, s, e), 5.0)], max_answer_length=e - s) != "wda wdb wdc"
    # [CLS] and the question are never answers: the best context span wins.
    assert answer([((f, 0, 0), 9.0), ((f, 1, 2), 8.0), ((f, s, int(t["end_positions"][f])), 1.0)]) == "wda"


@pytest.fixture(scope="session")
def xquad_tokenizer(tmp_path_factory):
    """A 4000-piece model of the English and Chinese XQuAD contexts and questions."""
    root = tmp_path_factory.mktemp("xquad")
    for lang in ("en", "zh"):
        squad = json.loads((SHARED / "xquad" / f"xquad.{lang}.json").read_text())
        text = [t for a in squad["data"] for p in a["paragraphs"] for t in [p["context"]] + [q["question"] for q in p["qas"]]]
        (root / f"{lang}.txt").write_text("\n".join(text) + "\n")
    return data.Tokenizer(data.train_tokenizer(str(root), 4000, str(root / "spm")))


@needs_shared
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_xquad_gold_answers_survive_features_and_decoding(xquad_tokenizer, lang, capsys):
    examples = data.read_squad(str(SHARED / "xquad" / f"xquad.{lang}.json"))
    t, meta = data.squad_features(xquad_tokenizer, examples, 384, 128, 64, training=True)
    n = len(meta)
    start, end = torch.full((n, 384), -10.0), torch.full((n, 384), -10.0)
    rows_with_answer = torch.nonzero(t["start_positions"] > 0).flatten()
    start[rows_with_answer, t["start_positions"][rows_with_answer]] = 10.0
    end[rows_with_answer, t["end_positions"][rows_with_answer]] = 10.0
    predicted = data.decode_spans(examples, meta, start, end, n_best=20, max_answer_length=1000)
    misses = [(e.id, e.answers[0]["text"], predicted[e.id]) for e in examples if predicted[e.id] != e.answers[0]["text"]]
    with capsys.disabled():
        print(f"\nxquad.{lang}: {len(examples) - len(misses)}/{len(examples)} gold answers decoded exactly; misses:")
        for miss in misses:
            print("  ", miss)
    # Each miss is a piece that runs past the answer ("(ARTS)," "24 次拦截"): the answer ends inside it.
    for _, gold, got in misses:
        assert got.startswith(gold) or got.endswith(gold)
    assert len(misses) / len(examples) <= 0.01
