"""Data for RemBERT: the SentencePiece vocabulary, the multilingual masked-LM input stream of pre-training,
and the XTREME task formats of fine-tuning (Chung et al., ICLR 2021, Section 3, Appendix A.3-A.7;
pre-training input as in mBERT / google-research/bert create_pretraining_data.py, task features as in
run_squad.py / XTREME).

Tokenizer (Appendix A.3: SentencePiece trained with unigram language modeling)
  train_tokenizer(files, vocab_size, model_prefix, alpha=0.5) -> "PREFIX.model". The training text is sampled
      per language with p_l ∝ n_l^alpha (as pre-training), so small languages get pieces. Pieces 0-4 are
      [PAD] [UNK] [CLS] [SEP] [MASK]; [CLS] [SEP] [MASK] are control symbols (the text "[MASK]" is never one).
  Tokenizer(model_file): any SentencePiece model, e.g. the released RemBERT sentencepiece.model ([CLS], [SEP],
      [MASK], [PAD] are looked up by name). .pad_id .unk_id .cls_id .sep_id .mask_id .vocab_size;
      encode(text) -> ids; encode_with_offsets(text) -> (ids, [(start, end)]) character offsets into the ORIGINAL
      text (before SentencePiece's NFKC / whitespace normalization), leading whitespace excluded; decode(ids).

Masked-LM stream (pre-training)
  loader = MLMLoader(data, tokenizer, batch_size=32, seq_len=128, max_predictions=20, seed=0, rank=0,
                     world_size=1, num_workers=0, alpha=0.5, whole_word_masking=False, infinite=False)
  for batch in loader: logits, loss = model(**batch)      # one epoch (infinite=True: never ends)
  checkpoint["loader"] = loader.state_dict();  later: loader.load_state_dict(checkpoint["loader"])
  `data`: a file, a directory (its *.txt and *.txt.gz), a list of files, or {language: [files]}. Files are UTF-8
  text, one sentence per line, a blank line ends a document; the language is the file name up to its first dot
  (en.txt, en.1.txt.gz). Batches: input_ids, token_type_ids (zeros: no NSP), attention_mask (B, T) long;
  masked_positions, masked_ids (B, P) long; masked_weights (B, P) float, 0 on padding.
  How the stream is made (every choice is a pure function of the seed and a position, so it resumes exactly):
  * Streams. Slot b of the global batch (rank * batch_size + b) of DataLoader worker w is stream
    s = w * global_batch + rank * batch_size + b, one of S = max(num_workers, 1) * global_batch. Stream s reads
    share s of every file: the lines that start in bytes [s/S, (s+1)/S) of it (gzip files, which cannot seek:
    every S-th block of lines). So the (rank, worker) pairs read disjoint shares whose union is the corpus, and
    the global batch does not depend on how it is split over processes (2 x 16 reads what 1 x 32 reads).
  * Languages. Each sequence comes from one language, drawn with p_l ∝ n_l^alpha (n_l: the language's lines,
    counted in one streaming pass that also checks every file, cached per process).
  * Shuffling, bounded: a share is cut into chunks of `shuffle_bytes`; chunks are read in a random order (a
    .gz file's in order), the documents of a chunk (its lines split at blank lines) in a random order, lines in
    order. Memory: one chunk per stream and language.
  * Packing: [CLS] + the language's next pieces + [SEP], filled to seq_len across line and document boundaries
    (RoBERTa's FULL-SENTENCES); a long line continues in the next sequence. Nothing is cut off.
  * Masking (create_pretraining_data.py): 15% of the pieces, at most max_predictions, never [CLS]/[SEP]; of
    those 80% [MASK], 10% a random ordinary piece, 10% unchanged; whole_word_masking masks every piece of a word
    (a word starts with "▁").
  * Epochs. A language's share repeats, reshuffled, when it is used up (alpha < 1 repeats small languages:
    that is the upsampling). An epoch of a stream ends when every language of its share has been used up at
    least once; a stream whose epoch ended fills its rows with padding (weights 0) until the other streams of its
    worker are done too, so one epoch reads every line at least once, a one-language corpus exactly once.
    That padding is the price of exact epochs (on the tiny sample corpus with 32 streams, about 45% of the
    rows): pre-training passes infinite=True, where a stream simply goes on and no row is ever padding.
  * Resuming: state_dict() is a small dict of ints (positions, per stream and language); workers send theirs
    with every batch. A loader restored with load_state_dict() yields exactly the batches the uninterrupted one
    would have yielded, with or without workers.
  Bad input fails before any batch: a missing or empty file, or a non-UTF-8 byte (with the line number).

XTREME tasks (Section 3, Appendix A.4): read_pairs (XNLI, PAWS-X TSV), read_tagging (PAN-X, UD-POS),
read_squad (XQuAD, MLQA, TyDiQA-GoldP) -> examples; pair_features, tagging_features, squad_features -> dicts
of (N, seq_len) tensors the task heads of model.py take as **kwargs; tagging_predictions and decode_spans map
outputs back to one label per word and to answer text cut from the original context.

Command line:
  python data.py tokenizer --input sample_data/*.txt --vocab-size 8000 --out out/tokenizer/spm
"""

import argparse
import collections
import copy
import csv
import glob
import gzip
import io
import json
import os
import random
import re
import tempfile
import warnings
from dataclasses import dataclass, field

import numpy as np
import sentencepiece as spm
import torch

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
WORD_START = "\u2581"  # SentencePiece's "▁": the piece begins a word

LABEL_ALIASES = {"contradictory": "contradiction"}  # XNLI-MT's translated MultiNLI train files


class DataError(ValueError):
    """Bad input; the message names the file and line (or question id)."""


# ----------------------------------------------------------------------------------------------
# Corpus files: languages, one checking and counting pass, documents by byte range

def corpus_files(data):
    """{language: [paths]} from a file, a directory (*.txt, *.txt.gz), a list of files or {language: files}."""
    if isinstance(data, dict):
        langs = {lang: [str(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
                 for lang, paths in data.items()}
    else:
        paths = [data] if isinstance(data, (str, os.PathLike)) else list(data)
        files = []
        for path in map(str, paths):
            if os.path.isdir(path):
                found = sorted(glob.glob(os.path.join(path, "*.txt")) + glob.glob(os.path.join(path, "*.txt.gz")))
                if not found:
                    raise DataError(f"{path}: no *.txt or *.txt.gz files in this directory")
                files += found
            else:
                files.append(path)
        langs = {}
        for path in files:
            langs.setdefault(os.path.basename(path).split(".")[0], []).append(path)
    for paths in langs.values():
        for path in paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file")
    if not langs:
        raise DataError("no input files")
    return langs


def _open_binary(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


_BLANK_LINE = re.compile(rb"^[ \t\r\f\v]*$", re.MULTILINE)
_SCANS = {}


def scan_file(path):
    """One streaming pass over a file: checks that it is non-empty UTF-8 and counts its non-blank lines, all
    its lines and its bytes (uncompressed). Cached per process by (path, size, mtime)."""
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SCANS:
        lines = blank = size = 0
        with _open_binary(path) as f:
            while chunk := f.read(1 << 22):
                chunk += f.readline()  # whole lines only
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError as e:
                    line = lines + chunk[:e.start].count(b"\n") + 1
                    raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{chunk[e.start]:02x}); convert the file "
                                    f"to UTF-8") from None
                size += len(chunk)
                blank += len(_BLANK_LINE.findall(chunk)) - chunk.endswith(b"\n")  # "" after the last \n
                lines += chunk.count(b"\n") + (not chunk.endswith(b"\n"))
        if size == 0:
            raise DataError(f"{path}: empty file")
        if lines == blank:
            raise DataError(f"{path}: only blank lines")
        _SCANS[key] = {"lines": lines - blank, "raw_lines": lines, "bytes": size}
    return _SCANS[key]


def _documents(lines):
    """Raw lines -> documents (lists of stripped, decoded lines), split at blank lines."""
    docs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.decode("utf-8").strip())
        elif current:
            docs.append(current)
            current = []
    if current:
        docs.append(current)
    return docs


def read_chunk(path, start, stop):
    """The lines of a plain-text file that start in bytes [start, stop), as documents (split at blank lines;
    a document that crosses `start` or `stop` is cut there). Every line belongs to exactly one range of any
    partition of [0, size), so byte ranges shard a file with no line lost or repeated."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line holding byte start - 1 belongs to the range before
        position, lines = f.tell(), []
        while position < stop and (line := f.readline()):
            lines.append(line)
            position += len(line)
    return _documents(lines)


def iter_lines(path):
    """The raw lines of a file, streaming (also .gz)."""
    with _open_binary(path) as f:
        yield from f


def sampling_probabilities(counts, alpha):
    """p_l ∝ n_l^alpha (Appendix A.7: alpha = 0.5; mBERT used 0.7): {language: probability}."""
    weights = {lang: n ** alpha for lang, n in counts.items()}
    total = sum(weights.values())
    return {lang: w / total for lang, w in weights.items()}


# ----------------------------------------------------------------------------------------------
# Tokenizer

class Tokenizer:
    """A SentencePiece model with the special pieces BERT's input format needs."""

    def __init__(self, model_file):
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"{model_file}: no such SentencePiece model")
        self.model_file = str(model_file)
        with open(model_file, "rb") as f:
            self._load(f.read())

    def _load(self, proto):
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.vocab_size = self.sp.get_piece_size()

        def piece_id(piece, fallback=-1):
            i = self.sp.piece_to_id(piece)
            if self.sp.id_to_piece(i) == piece:  # piece_to_id answers unk_id for unknown pieces
                return i
            if fallback < 0:
                raise DataError(f"{self.model_file}: no {piece} piece in this SentencePiece model")
            return fallback

        self.unk_id = self.sp.unk_id()
        self.pad_id = piece_id(PAD, self.sp.pad_id())
        self.cls_id, self.sep_id, self.mask_id = piece_id(CLS), piece_id(SEP), piece_id(MASK)
        special = np.array([self.sp.is_control(i) or self.sp.is_unknown(i) or self.sp.is_unused(i)
                            for i in range(self.vocab_size)])
        special[[self.pad_id, self.cls_id, self.sep_id, self.mask_id]] = True
        self.normal_ids = np.flatnonzero(~special)  # what a "random token" of the 80/10/10 rule may be
        self.word_start = np.array([self.sp.id_to_piece(i).startswith(WORD_START) for i in range(self.vocab_size)])

    def __getstate__(self):  # DataLoader workers may be spawned: send the model itself
        return {"model_file": self.model_file, "proto": self.sp.serialized_model_proto()}

    def __setstate__(self, state):
        self.model_file = state["model_file"]
        self._load(state["proto"])

    def encode(self, text):
        return self.sp.encode(text)

    def encode_with_offsets(self, text):
        """(ids, [(start, end)]): each piece's characters in `text` itself, found through SentencePiece's
        normalization (NFKC, collapsed whitespace); the "▁" of a word start is not counted, so a lone "▁" piece
        has an empty span."""
        out = self.sp.encode(text, return_type="offset_mapping")
        offsets = []
        for start, end in out["offsets"]:
            while start < end and text[start].isspace():
                start += 1
            offsets.append((start, end))
        return out["ids"], offsets

    def decode(self, ids):
        return self.sp.decode([int(i) for i in ids])


def train_tokenizer(files, vocab_size, model_prefix, alpha=0.5, max_sentences=1_000_000, seed=0,
                    character_coverage=0.9995):
    """Train a unigram SentencePiece model on text sampled across languages with p_l ∝ n_l^alpha: language l
    contributes round(M * p_l) lines (M = all lines, at most max_sentences), drawn at random from its files
    (repeated when it has fewer). Streams the files; only the sample is held. Returns the .model path.
    The vocabulary is a soft limit: a corpus too small for vocab_size gives fewer pieces. A vocabulary too
    small for the corpus's alphabet (10 scripts and 500 pieces) keeps only its vocab_size // 2 most frequent
    characters; the others become [UNK]."""
    langs = corpus_files(files)
    counts = {lang: sum(scan_file(p)["lines"] for p in paths) for lang, paths in langs.items()}
    probabilities = sampling_probabilities(counts, alpha)
    total = min(max_sentences, sum(counts.values()))
    rng = random.Random(seed)
    chars = collections.Counter()
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sample = os.path.join(tmp, "sample.txt")
        with open(sample, "w", encoding="utf-8") as out:
            for lang, paths in langs.items():
                wanted = max(1, round(total * probabilities[lang]))
                repeats, rest = divmod(wanted, counts[lang])
                reservoir, seen = [], 0  # Algorithm R: a uniform sample of `rest` lines, one pass
                for path in paths:
                    for raw in iter_lines(path):
                        if not (line := raw.decode("utf-8").strip()):
                            continue
                        out.write((line + "\n") * repeats)
                        chars.update(line * repeats)
                        seen += 1
                        if len(reservoir) < rest:
                            reservoir.append(line)
                        elif (j := rng.randrange(seen)) < rest:
                            reservoir[j] = line
                out.writelines(line + "\n" for line in reservoir)
                chars.update("".join(reservoir))
        if len(chars) > vocab_size // 2:  # SentencePiece needs a piece for every character it keeps
            rare = {ord(c): " " for c, _ in chars.most_common()[vocab_size // 2:]}
            kept = os.path.join(tmp, "kept.txt")
            with open(sample, encoding="utf-8") as f, open(kept, "w", encoding="utf-8") as out:
                out.writelines(line.translate(rare) for line in f)
            sample = kept
        spm.SentencePieceTrainer.train(
            input=sample, model_prefix=str(model_prefix), vocab_size=vocab_size, model_type="unigram",
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=PAD, unk_piece=UNK, bos_piece=CLS, eos_piece=SEP,
            control_symbols=[MASK], character_coverage=character_coverage, hard_vocab_limit=False,
            input_sentence_size=0, max_sentence_length=1 << 16, num_threads=os.cpu_count() or 1,
            minloglevel=2)
    return f"{model_prefix}.model"


# ----------------------------------------------------------------------------------------------
# Masked-LM stream

def mask_tokens(ids, rng, tokenizer, max_predictions, masked_lm_prob=0.15, whole_word_masking=False):
    """create_pretraining_data.py's create_masked_lm_predictions on one [CLS] ... [SEP] sequence (a list):
    returns (input ids with the masks applied, sorted masked positions, their original ids)."""
    candidates = []  # lists of positions masked together (a word, with whole-word masking)
    for i in range(1, len(ids) - 1):
        if whole_word_masking and candidates and not tokenizer.word_start[ids[i]]:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    to_predict = min(max_predictions, max(1, round(len(ids) * masked_lm_prob)))
    output, positions = list(ids), []
    for k in rng.permutation(len(candidates)):
        if len(positions) >= to_predict:
            break
        if len(positions) + len(candidates[k]) > to_predict:
            continue
        for i in candidates[k]:
            if rng.random() < 0.8:
                output[i] = tokenizer.mask_id
            elif rng.random() >= 0.5:  # else: keep the original
                output[i] = int(tokenizer.normal_ids[rng.integers(len(tokenizer.normal_ids))])
            positions.append(i)
    positions.sort()
    return output, positions, [ids[i] for i in positions]


@dataclass
class _Corpus:
    """What every stream needs, the same in every process (picklable for DataLoader workers)."""
    langs: list  # [(language, [paths])], sorted
    counts: list  # lines per language
    info: dict  # path -> scan_file(path)
    streams: int  # S
    seed: int
    shuffle_bytes: int
    alpha: float


class _Reader:
    """One stream's share of one language: chunks in a random order per pass, documents shuffled within a
    chunk. `state` (a dict of ints, updated in place) is all it needs to continue where it was."""

    def __init__(self, corpus, lang_index, stream, tokenizer, state):
        self.corpus, self.lang_index, self.stream, self.tokenizer, self.state = corpus, lang_index, stream, tokenizer, state
        self.chunks = []  # (file index, start, stop): bytes of a plain file, or line numbers of a .gz file
        S, s = corpus.streams, stream
        for f, path in enumerate(corpus.langs[lang_index][1]):
            info = corpus.info[path]
            if path.endswith(".gz"):  # blocks of lines s, s + S, s + 2S, ... of about shuffle_bytes each
                block = max(1, corpus.shuffle_bytes * info["raw_lines"] // info["bytes"])
                self.chunks += [(f, k * block, min((k + 1) * block, info["raw_lines"]))
                                for k in range(s, -(-info["raw_lines"] // block), S)]
            else:
                start, stop = info["bytes"] * s // S, info["bytes"] * (s + 1) // S
                self.chunks += [(f, c, min(c + corpus.shuffle_bytes, stop))
                                for c in range(start, stop, corpus.shuffle_bytes)]
        self.order = self.docs = self.line_ids = None
        self.gz = None  # (file index, line iterator, number of its next line)

    def _rng(self, *keys):
        return np.random.default_rng([self.corpus.seed, self.stream, self.lang_index, self.state["pass"], *keys])

    def _chunk_docs(self, f, start, stop):
        path = self.corpus.langs[self.lang_index][1][f]
        if not path.endswith(".gz"):
            return read_chunk(path, start, stop)
        if self.gz is None or self.gz[0] != f or self.gz[2] > start:  # gzip cannot seek back: read again
            self.gz = (f, iter_lines(path), 0)
        _, lines, i = self.gz
        for _ in range(start - i):
            next(lines)
        self.gz = (f, lines, stop)
        return _documents([next(lines) for _ in range(stop - start)])

    def _load(self):
        """Make docs[doc][line] the current line; False at the end of the pass."""
        st = self.state
        if self.order is None:
            order = self._rng().permutation(len(self.chunks))
            for f in {c[0] for c in self.chunks}:  # a .gz file is read front to back: its chunks in order
                slots = [k for k, c in enumerate(order) if self.chunks[c][0] == f]
                if self.corpus.langs[self.lang_index][1][f].endswith(".gz"):
                    for k, c in zip(slots, sorted(order[slots])):
                        order[k] = c
            self.order = order
        while self.docs is None or st["doc"] >= len(self.docs):
            if self.docs is not None:
                st["chunk"], st["doc"], st["line"] = st["chunk"] + 1, 0, 0
            if st["chunk"] >= len(self.chunks):
                self.docs = None
                return False
            docs = self._chunk_docs(*self.chunks[self.order[st["chunk"]]])
            self.docs = [docs[i] for i in self._rng(st["chunk"]).permutation(len(docs))]
        return True

    def take(self, n):
        """Up to n pieces of the current line (fewer at its end); None when the pass is over (the reader
        then starts its next pass)."""
        st = self.state
        while True:
            if self.line_ids is None:
                if not self._load():
                    self._next_pass()
                    return None
                self.line_ids = self.tokenizer.encode(self.docs[st["doc"]][st["line"]])
                st["any"] = 1
            if st["token"] < len(self.line_ids):
                piece = self.line_ids[st["token"]:st["token"] + n]
                st["token"] += len(piece)
                return piece
            self.line_ids, st["token"], st["line"] = None, 0, st["line"] + 1
            if st["line"] >= len(self.docs[st["doc"]]):
                st["doc"], st["line"] = st["doc"] + 1, 0

    def _next_pass(self):
        st = self.state
        if st["any"]:
            st["used_up"] = 1
        else:
            st["empty"] = 1  # this share of the language holds no text: the stream never draws it again
        st.update({"pass": st["pass"] + 1, "chunk": 0, "doc": 0, "line": 0, "token": 0, "any": 0})
        self.order = self.docs = None


def _new_stream_state(num_langs):
    return {"seq": 0, "done": 0, "readers": [
        {"pass": 0, "chunk": 0, "doc": 0, "line": 0, "token": 0, "any": 0, "used_up": 0, "empty": 0}
        for _ in range(num_langs)]}


class _Stream:
    """One slot of the global batch: a sequence of [CLS] ... [SEP] rows, each from one language."""

    def __init__(self, corpus, stream, tokenizer, state, seq_len, infinite):
        self.corpus, self.stream, self.state, self.seq_len, self.infinite = corpus, stream, state, seq_len, infinite
        self.readers = [_Reader(corpus, i, stream, tokenizer, r) for i, r in enumerate(state["readers"])]
        self.weights = np.array(corpus.counts, dtype=np.float64) ** corpus.alpha

    def next_row(self):
        """(pieces without [CLS]/[SEP], rng for the masking), or None once this stream's epoch is over."""
        st = self.state
        if st["done"]:
            return None
        rng = np.random.default_rng([self.corpus.seed, self.stream, st["seq"], 1 << 30])
        st["seq"] += 1
        ids, lang = [], None
        while len(ids) < self.seq_len - 2:
            if lang is None:
                live = [i for i, r in enumerate(self.readers) if not r.state["empty"]]
                if not live:
                    raise DataError(f"stream {self.stream} of {self.corpus.streams} has no text: the corpus is too "
                                    f"small for world_size x batch_size x num_workers shares")
                cumulative = np.cumsum(self.weights[live])
                lang = live[min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")),
                                len(live) - 1)]
            piece = self.readers[lang].take(self.seq_len - 2 - len(ids))
            if piece is not None:
                ids += piece
                continue
            if self.readers[lang].state["empty"]:
                lang = None  # draw again, among the languages this share has
                continue
            if not self.infinite and all(r.state["used_up"] or r.state["empty"] for r in self.readers):
                st["done"] = 1
                break
        return (ids, rng) if ids else None


def _worker_batches(corpus, tokenizer, config, worker, state):
    """The batches of one (rank, worker): forever, as (batch or None, state after it, worker). None once all
    the worker's streams have finished the epoch (the main process then starts the next one)."""
    batch_size, seq_len, max_predictions, rank, world_size, whole_word, infinite = config
    first = worker * batch_size * world_size + rank * batch_size
    streams = [_Stream(corpus, first + b, tokenizer, st, seq_len, infinite) for b, st in enumerate(state["streams"])]
    while True:
        if state["done"]:
            yield None, state, worker
            continue
        input_ids = np.full((batch_size, seq_len), tokenizer.pad_id, dtype=np.int64)
        attention_mask = np.zeros((batch_size, seq_len), dtype=np.int64)
        positions = np.zeros((batch_size, max_predictions), dtype=np.int64)
        masked_ids = np.zeros((batch_size, max_predictions), dtype=np.int64)
        weights = np.zeros((batch_size, max_predictions), dtype=np.float32)
        for b, stream in enumerate(streams):
            row = stream.next_row()
            if row is None:
                continue  # padding: this stream's epoch is over
            ids, rng = row
            ids = [tokenizer.cls_id] + ids + [tokenizer.sep_id]
            masked, pos, original = mask_tokens(ids, rng, tokenizer, max_predictions, whole_word_masking=whole_word)
            input_ids[b, :len(ids)] = masked
            attention_mask[b, :len(ids)] = 1
            positions[b, :len(pos)], masked_ids[b, :len(pos)], weights[b, :len(pos)] = pos, original, 1.0
        state["done"] = int(all(s.state["done"] for s in streams))
        batch = {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.zeros_like(torch.from_numpy(input_ids)),
                 "attention_mask": torch.from_numpy(attention_mask), "masked_positions": torch.from_numpy(positions),
                 "masked_ids": torch.from_numpy(masked_ids), "masked_weights": torch.from_numpy(weights)}
        yield batch, copy.deepcopy(state), worker


class _WorkerStreams(torch.utils.data.IterableDataset):
    def __init__(self, corpus, tokenizer, config, workers, states):
        self.corpus, self.tokenizer, self.config, self.workers, self.states = corpus, tokenizer, config, workers, states

    def __iter__(self):
        p = torch.utils.data.get_worker_info().id
        return _worker_batches(self.corpus, self.tokenizer, self.config, self.workers[p], self.states[p])


def _identity(item):
    return item


class MLMLoader:
    """The masked-LM input stream (see the module docstring). Iterating yields one epoch of batches; iterate
    again for the next. infinite=True: one endless iteration with no padding rows (for pre-training).
    state_dict() after any batch, load_state_dict() before iterating: exact resume."""

    def __init__(self, data, tokenizer, batch_size=32, seq_len=128, max_predictions=20, seed=0, rank=0,
                 world_size=1, num_workers=0, alpha=0.5, whole_word_masking=False, shuffle_bytes=1 << 16,
                 infinite=False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if seq_len < 3 or batch_size < 1 or max_predictions < 1 or num_workers < 0 or seed < 0:
            raise ValueError("need seq_len >= 3, batch_size >= 1, max_predictions >= 1, num_workers >= 0, seed >= 0")
        self.tokenizer, self.batch_size, self.num_workers = tokenizer, batch_size, num_workers
        langs = sorted(corpus_files(data).items())
        info = {p: scan_file(p) for _, paths in langs for p in paths}
        counts = [sum(info[p]["lines"] for p in paths) for _, paths in langs]
        workers = max(num_workers, 1)
        self.corpus = _Corpus(langs, counts, info, workers * batch_size * world_size, seed, shuffle_bytes, alpha)
        self.config = (batch_size, seq_len, max_predictions, rank, world_size, whole_word_masking, infinite)
        self.languages = {lang: n for (lang, _), n in zip(langs, counts)}
        self.probabilities = sampling_probabilities(self.languages, alpha)
        self._fingerprint = {"files": [[lang, p, info[p]["bytes"]] for lang, paths in langs for p in paths],
                             "streams": self.corpus.streams, "seed": seed, "config": list(self.config),
                             "num_workers": num_workers, "shuffle_bytes": shuffle_bytes, "alpha": alpha}
        self._state = {"epoch": 0, "next_worker": 0, "workers": [
            {"done": 0, "streams": [_new_stream_state(len(langs)) for _ in range(batch_size)]}
            for _ in range(workers)]}

    def state_dict(self):
        return copy.deepcopy({"fingerprint": self._fingerprint, **self._state})

    def load_state_dict(self, state):
        if state.get("fingerprint") != self._fingerprint:
            raise ValueError("this loader state was saved for other data or settings (files, seed, batch_size, "
                             f"seq_len, rank, world_size, num_workers): saved {state.get('fingerprint')}, now "
                             f"{self._fingerprint}")
        self._state = copy.deepcopy({k: v for k, v in state.items() if k != "fingerprint"})

    def _end_epoch(self):
        st = self._state
        st["epoch"] += 1
        for worker in st["workers"]:
            worker["done"] = 0
            for stream in worker["streams"]:
                stream["done"] = 0
                for reader in stream["readers"]:
                    reader["used_up"] = 0

    def __iter__(self):
        st = self._state
        if all(w["done"] for w in st["workers"]):
            self._end_epoch()
        n = len(st["workers"])
        logical = [(st["next_worker"] + p) % n for p in range(n)]  # DataLoader asks worker 0, 1, ... in turn
        states = [copy.deepcopy(st["workers"][w]) for w in logical]
        if self.num_workers == 0:
            source = _worker_batches(self.corpus, self.tokenizer, self.config, 0, states[0])
        else:
            source = iter(torch.utils.data.DataLoader(
                _WorkerStreams(self.corpus, self.tokenizer, self.config, logical, states), batch_size=None,
                num_workers=self.num_workers, collate_fn=_identity))
        for batch, worker_state, w in source:
            st["workers"][w], st["next_worker"] = worker_state, (w + 1) % n
            if batch is not None:
                yield batch
            if all(wk["done"] for wk in st["workers"]):
                break
        self._end_epoch()


# ----------------------------------------------------------------------------------------------
# XTREME tasks: reading

@dataclass
class PairExample:
    sentence1: str
    sentence2: str
    label: str  # None in a file without labels
    source: str  # "file:line", for error messages


@dataclass
class TaggingExample:
    tokens: list
    labels: list  # None in a file without labels
    source: str


@dataclass
class SquadExample:
    id: str
    question: str
    context: str
    answers: list  # [{"text", "answer_start"}]
    article: int  # index of the article in its file
    source: str


def _read_text(path):
    """A whole task file (they are small) as text, with a line number for a non-UTF-8 byte."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None


def _check_label(label, labels, source):
    if label not in labels:
        raise DataError(f"{source}: unknown label {label!r}; expected one of {', '.join(labels)}")
    return labels.index(label)


def _check_fields(where, fields, width, allowed, expected):
    """The line's number of tab-separated fields: one of `allowed`, and the first line's (`width`)."""
    if width is None and len(fields) not in allowed:
        raise DataError(f"{where}: {len(fields)} tab-separated fields; expected {expected}")
    if width is not None and len(fields) != width:
        raise DataError(f"{where}: {len(fields)} tab-separated fields, the first line has {width}")
    return len(fields)


def read_pairs(path, labels=None):
    """XNLI / PAWS-X sentence pairs. XTREME's TSV (sentence1<TAB>sentence2<TAB>label, no header, written by
    Python's csv module: a field holding a quote is quoted, its quotes doubled) or, with a header row, the
    original releases (XNLI's sentence1/sentence2/gold_label, XNLI-MT's premise/hypo/label, PAWS-X's
    id/sentence1/sentence2/label; quotes are plain characters there). Lines end at "\\n" only: a sentence may
    hold U+001C, which str.splitlines() would break on. Two columns: no labels. `labels` checks them."""
    text = _read_text(path)
    header = text.split("\n", 1)[0].rstrip("\r").split("\t")
    columns = None
    if {"label", "gold_label"} & set(header):
        names = [("sentence1", "premise"), ("sentence2", "hypo"), ("gold_label", "label")]
        columns = [next((header.index(n) for n in alternatives if n in header), None) for alternatives in names]
        if None in columns:
            raise DataError(f"{path}:1: a header without sentence1/premise, sentence2/hypo and label columns: {header}")
    quoting = csv.QUOTE_NONE if columns else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=quoting, strict=True)
    examples, width = [], None
    try:
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if columns:
                if reader.line_num == 1:
                    continue
                if len(row) != len(header):
                    raise DataError(f"{where}: {len(row)} fields, the header has {len(header)}")
                row = [row[i] for i in columns]
            width = _check_fields(where, row, width, (2, 3), "sentence1<TAB>sentence2[<TAB>label]")
            label = LABEL_ALIASES.get(row[2], row[2]) if width == 3 else None
            if labels is not None and label is not None:
                _check_label(label, labels, where)
            examples.append(PairExample(row[0], row[1], label, where))
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: {e}") from None
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


_LANG_PREFIX = re.compile(r"^[a-z]{2,3}:")


def read_tagging(path, labels=None):
    """PAN-X / UD-POS: token<TAB>label lines, a blank line between sentences (a token alone: no labels). The
    raw XTREME files prefix every token with its language ("en:Paris"); when all tokens share one such
    prefix, it is removed."""
    sentences, current, width = [], [], None
    for number, line in enumerate(_read_text(path).split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            if current:
                sentences.append(current)
                current = []
            continue
        fields = line.split("\t")
        width = _check_fields(f"{path}:{number}", fields, width, (1, 2), "token[<TAB>label]")
        if labels is not None and width == 2:
            _check_label(fields[1], labels, f"{path}:{number}")
        current.append((number, fields))
    if current:
        sentences.append(current)
    if not sentences:
        raise DataError(f"{path}: no sentences")
    prefixes = {(_LANG_PREFIX.match(f[0]) or [None])[0] for s in sentences for _, f in s}
    cut = len(next(iter(prefixes))) if len(prefixes) == 1 and None not in prefixes else 0
    return [TaggingExample([f[0][cut:] for _, f in s], [f[1] for _, f in s] if width == 2 else None,
                           f"{path}:{s[0][0]}") for s in sentences]


def read_squad(path):
    """SQuAD v1.1 JSON (XQuAD, MLQA, TyDiQA-GoldP): one example per question. Every answer must be found at
    its answer_start in the context."""
    try:
        squad = json.loads(_read_text(path))
        articles = squad["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not SQuAD-format JSON ({e})") from None
    examples = []
    for a, article in enumerate(articles):
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                where = f"{path}: question {qa.get('id')!r}"
                for answer in qa.get("answers", []):
                    start, text = answer["answer_start"], answer["text"]
                    if context[start:start + len(text)] != text:
                        raise DataError(f"{where}: answer {text!r} is not at answer_start {start} of the context "
                                        f"(found {context[start:start + len(text)]!r})")
                examples.append(SquadExample(qa["id"], qa["question"], context, qa.get("answers", []), a, where))
    if not examples:
        raise DataError(f"{path}: no questions")
    return examples


# ----------------------------------------------------------------------------------------------
# XTREME tasks: features (static shapes: every row padded to seq_len)

def to_tensors(features, seq_len, pad_id):
    """Features (dicts with "input_ids", "token_type_ids" and per-position lists or per-sequence ints such as
    "labels", "start_positions") -> a dict of (N, seq_len) / (N,) long tensors, with "attention_mask".
    Padding: pad_id in input_ids, 0 in token_type_ids, -100 (ignored by the loss) in other lists."""
    n = len(features)
    out = {"attention_mask": torch.zeros(n, seq_len, dtype=torch.long)}
    for key in features[0]:
        if isinstance(features[0][key], list):
            out[key] = torch.full((n, seq_len), {"input_ids": pad_id, "token_type_ids": 0}.get(key, -100),
                                  dtype=torch.long)
            for i, f in enumerate(features):
                out[key][i, :len(f[key])] = torch.tensor(f[key], dtype=torch.long)
        else:
            out[key] = torch.tensor([f[key] for f in features], dtype=torch.long)
    for i, f in enumerate(features):
        out["attention_mask"][i, :len(f["input_ids"])] = 1
    return out


def pair_features(tokenizer, examples, labels, seq_len):
    """[CLS] sentence1 [SEP] sentence2 [SEP], the longer sentence cut first (BERT's _truncate_seq_pair);
    labels as indices into `labels` (-100 without a label)."""
    features = []
    for e in examples:
        a, b = tokenizer.encode(e.sentence1), tokenizer.encode(e.sentence2)
        while len(a) + len(b) > seq_len - 3:
            (a if len(a) > len(b) else b).pop()
        features.append({"input_ids": [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id],
                         "token_type_ids": [0] * (len(a) + 2) + [1] * (len(b) + 1),
                         "labels": -100 if e.label is None else _check_label(e.label, labels, e.source)})
    return to_tensors(features, seq_len, tokenizer.pad_id)


def tagging_features(tokenizer, examples, labels, seq_len):
    """One row per sentence: [CLS] pieces of each word [SEP]. A word's label goes to its first piece; the
    other pieces, [CLS], [SEP] and padding get -100. A word with no pieces gets [UNK]. Words past seq_len - 2
    pieces are cut (a warning counts them; tagging_predictions gives them labels[0]). Without gold labels,
    first pieces get label 0, so that tagging_predictions can still find the words (do not train on them)."""
    features, cut = [], 0
    for e in examples:
        ids, row_labels = [tokenizer.cls_id], [-100]
        for k, word in enumerate(e.tokens):
            pieces = tokenizer.encode(word) or [tokenizer.unk_id]
            if len(ids) + len(pieces) > seq_len - 1:
                cut += len(e.tokens) - k
                break
            ids += pieces
            row_labels += [0 if e.labels is None else _check_label(e.labels[k], labels, e.source)]
            row_labels += [-100] * (len(pieces) - 1)
        features.append({"input_ids": ids + [tokenizer.sep_id], "token_type_ids": [0] * (len(ids) + 1),
                         "labels": row_labels + [-100]})
    if cut:
        warnings.warn(f"{cut} words did not fit in {seq_len} pieces; they are predicted as {labels[0]!r}")
    return to_tensors(features, seq_len, tokenizer.pad_id)


def tagging_predictions(examples, tensors, predictions, labels):
    """(N, T) predicted label indices -> one list of labels per example, one label per word: the prediction at
    the word's first piece (where tensors["labels"] is not -100)."""
    out = []
    for e, gold, predicted in zip(examples, tensors["labels"], predictions):
        words = [labels[i] for i in predicted[gold != -100].tolist()]
        out.append(words + [labels[0]] * (len(e.tokens) - len(words)))
    return out


def squad_features(tokenizer, examples, seq_len, doc_stride, max_query_length, training=False):
    """run_squad.py's convert_examples_to_features: [CLS] question [SEP] context window [SEP], the question cut
    to max_query_length pieces, windows starting every doc_stride pieces. training=True adds start_positions /
    end_positions (the first answer's pieces; 0, the [CLS], when the window does not hold it).
    Returns (tensors, meta); meta[i] = {"example": index into examples, "offsets": (start, end) characters of
    the context for each context position (None elsewhere), "max_context": [bool]} for decode_spans."""
    features, meta = [], []
    for index, e in enumerate(examples):
        question = tokenizer.encode(e.question)[:max_query_length]
        context_ids, offsets = tokenizer.encode_with_offsets(e.context)
        room = seq_len - len(question) - 3
        if room < 1:
            raise DataError(f"{e.source}: seq_len {seq_len} leaves no room for the context")
        if training:
            if not e.answers or not e.answers[0]["text"]:
                raise DataError(f"{e.source}: no answer to train on")
            start_char = e.answers[0]["answer_start"]
            end_char = start_char + len(e.answers[0]["text"])
            # The answer's pieces: from the first piece ending after its start to the last starting before its end.
            first = next((k for k, (_, end) in enumerate(offsets) if end > start_char), len(offsets))
            last = max((k for k, (start, _) in enumerate(offsets) if start < end_char), default=-1)
        windows, start = [], 0
        while True:
            windows.append((start, min(room, len(context_ids) - start)))
            if start + room >= len(context_ids):
                break
            start += min(room, doc_stride)
        for w_start, w_len in windows:
            ids = [tokenizer.cls_id, *question, tokenizer.sep_id, *context_ids[w_start:w_start + w_len], tokenizer.sep_id]
            shift = len(question) + 2  # position of the window's first piece
            feature = {"input_ids": ids, "token_type_ids": [0] * shift + [1] * (w_len + 1)}
            if training:
                inside = w_start <= first and last < w_start + w_len and first <= last
                feature["start_positions"] = first - w_start + shift if inside else 0
                feature["end_positions"] = last - w_start + shift if inside else 0
            features.append(feature)
            position_offsets = [None] * len(ids)
            position_offsets[shift:shift + w_len] = offsets[w_start:w_start + w_len]
            max_context = [False] * len(ids)
            for k in range(w_len):
                max_context[shift + k] = _is_max_context(windows, (w_start, w_len), w_start + k)
            meta.append({"example": index, "offsets": position_offsets, "max_context": max_context})
    return to_tensors(features, seq_len, tokenizer.pad_id), meta


def _is_max_context(windows, window, position):
    """run_squad.py's _check_is_max_context: a piece in several windows counts in the one where it has the most
    context, min(left, right) + 0.01 * window length."""
    best, best_score = None, None
    for w in windows:
        if w[0] <= position < w[0] + w[1]:
            score = min(position - w[0], w[0] + w[1] - 1 - position) + 0.01 * w[1]
            if best_score is None or score > best_score:
                best, best_score = w, score
    return best == window


def decode_spans(examples, meta, start_logits, end_logits, n_best=20, max_answer_length=30):
    """run_squad.py's n-best decoding: for each example, over its windows, the n_best highest start and end
    logits; pairs inside the context, end >= start, at most max_answer_length pieces, the start at its max
    context; the best start + end logit wins. The answer is cut from the ORIGINAL context by character
    offsets (no detokenization). Returns {question id: answer text} ("" when no span qualifies)."""
    start_logits, end_logits = start_logits.float().cpu(), end_logits.float().cpu()
    best = {}  # example index -> (score, text)
    for i, m in enumerate(meta):
        e = examples[m["example"]]
        offsets = m["offsets"]
        starts = torch.topk(start_logits[i], min(n_best, start_logits.shape[1])).indices.tolist()
        ends = torch.topk(end_logits[i], min(n_best, end_logits.shape[1])).indices.tolist()
        for s in starts:
            if s >= len(offsets) or offsets[s] is None or not m["max_context"][s]:
                continue
            for t in ends:
                if t >= len(offsets) or offsets[t] is None or t < s or t - s + 1 > max_answer_length:
                    continue
                score = float(start_logits[i, s] + end_logits[i, t])
                if m["example"] not in best or score > best[m["example"]][0]:
                    best[m["example"]] = (score, e.context[offsets[s][0]:offsets[t][1]])
    return {e.id: best[k][1] if k in best else "" for k, e in enumerate(examples)}


# ----------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("tokenizer", allow_abbrev=False,
                                help="train a unigram SentencePiece model on multilingual text")
    train.add_argument("--input", nargs="+", required=True,
                       help="text files (language = file name up to the first dot) or directories of *.txt")
    train.add_argument("--vocab-size", type=int, required=True, help="pieces (a soft limit for small corpora)")
    train.add_argument("--out", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--alpha", type=float, default=0.5, help="language sampling exponent (default: 0.5)")
    train.add_argument("--max-sentences", type=int, default=1_000_000,
                       help="lines sampled for training, at most (default: 1000000)")
    args = parser.parse_args(argv)
    langs = corpus_files(args.input)
    path = train_tokenizer(args.input, args.vocab_size, args.out, args.alpha, args.max_sentences)
    tokenizer = Tokenizer(path)
    print(f"{path}: {tokenizer.vocab_size} pieces from {sum(map(len, langs.values()))} files in {len(langs)} "
          f"languages ({', '.join(langs)})")


if __name__ == "__main__":
    main()
