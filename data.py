"""Data for RemBERT (Chung et al., ICLR 2021, Section 3, Appendix A.3-A.7): the SentencePiece vocabulary, the
multilingual masked-LM stream of pre-training (mBERT's input, after google-research/bert's create_pretraining_data.py)
and the readers of the XTREME task files.

MLMLoader yields batches forever (input_ids, token_type_ids, attention_mask (B, T); masked_positions, masked_ids,
masked_weights (B, P)), with an exact state_dict(); docs/data.md describes its data, languages, packing, masking,
shuffling and memory. Row b of micro-batch a of process `rank`, made by DataLoader worker w, is stream s = w * G +
(a * world_size + rank) * batch_size + b of S = max(num_workers, 1) * G (G: the global batch), which reads the lines
that start in bytes [s/S, (s+1)/S) of every file: a run resumes on any split of G over processes and accumulation.
"""

import collections
import csv
import functools
import glob
import hashlib
import io
import itertools
import json
import os
import random
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import sentencepiece as spm
import torch

from checkpoints import (CHECKPOINT_INFO, DataError, differences, open_input, read_checkpoint_info, read_text, sha256,
                         write_file)

if tuple(int(v) for v in re.findall(r"\d+", spm.__version__)[:3]) < (0, 2, 2):
    raise ImportError(f"data.py needs sentencepiece>=0.2.2, the first whose encode() gives character offsets; "
                      f"found {spm.__version__}: pip install -U 'sentencepiece>=0.2.2'")

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
LABEL_ALIASES = {"contradictory": "contradiction"}  # XNLI-MT's translated MultiNLI train files
NEWLINE = b"\n"
MAX_LINE = 8192  # characters: a longer corpus line is read as several (see in_parts)


class Tokenizer:
    """Any SentencePiece model (the released RemBERT one too), with the special pieces BERT's input format needs."""

    def __init__(self, model_file):
        self.model_file = str(model_file)
        with open_input(model_file, f"--tokenizer {model_file}") as f:  # read once (any path: not passed on)
            model = f.read()
        self.sha256 = hashlib.sha256(model).hexdigest()  # what a checkpoint records of it
        try:  # (a SentencePieceProcessor pickles as its model: DataLoader workers may be spawned)
            self.sp = spm.SentencePieceProcessor()
            self.sp.LoadFromSerializedProto(model)  # (model_proto=b"" would load nothing, without a word)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{self.model_file}: not a SentencePiece model ({e})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.unk_id = self.sp.unk_id()
        ids = []
        for piece, fallback in ((PAD, self.sp.pad_id()), (CLS, -1), (SEP, -1), (MASK, -1)):
            i = self.sp.piece_to_id(piece)  # (unk_id for a piece it does not have)
            ids.append(i if self.sp.id_to_piece(i) == piece else fallback)
            if ids[-1] < 0:
                raise DataError(f"{self.model_file}: no {piece} piece in this SentencePiece model")
        self.pad_id, self.cls_id, self.sep_id, self.mask_id = ids
        self.reserved = {self.pad_id, self.cls_id, self.sep_id, self.mask_id}  # the input format's own pieces
        self.normal_ids = np.flatnonzero([  # what a "random token" of the 80/10/10 rule may be
            not (i in self.reserved or self.sp.is_control(i) or self.sp.is_unknown(i) or self.sp.is_unused(i)
                 or self.sp.is_byte(i)) for i in range(self.vocab_size)])
        self._blank = {}  # is_blank's answers

    def encode(self, text):
        return self.sp.encode(text)

    def is_blank(self, char):
        """Whether SentencePiece reads `char` as nothing or a space: whitespace, U+200B, U+FEFF and the like."""
        if char not in self._blank:
            self._blank[char] = char.isspace() or not self.sp.normalize(char)
        return self._blank[char]

    def encode_with_offsets(self, text):
        """(ids, [(start, end)]): each piece's characters in `text` itself, through SentencePiece's normalization
        (NFKC, collapsed whitespace). A span never starts or ends with a blank (a word start's "▁" is not counted);
        a lone "▁" has an empty span, as have all but the last of a character's pieces (bytes; "…" -> "...")."""
        out = self.sp.encode(text, return_type="offset_mapping")
        offsets = []
        for start, end in out["offsets"]:
            while start < end and self.is_blank(text[start]):
                start += 1
            while end > start and self.is_blank(text[end - 1]):
                end -= 1
            offsets.append((start, end))
        return out["ids"], offsets


def tokenizer_for(model_path, tokenizer_file=""):
    """The tokenizer of a saved model: `tokenizer_file`, or else the one saved with it (a Hugging Face
    directory's sentencepiece.model, the file a pretrain.py checkpoint recorded). Where both are known they
    must be the same model (by SHA-256): another vocabulary would give the model wrong ids without a word."""
    path = os.path.join(model_path, "sentencepiece.model")
    if os.path.isfile(os.path.join(model_path, CHECKPOINT_INFO)):  # a pretrain.py checkpoint
        saved = read_checkpoint_info(model_path, verify=False)["tokenizer"]  # (the model's loader checks it)
    else:
        saved = {"path": path, "sha256": sha256(path)} if os.path.isfile(path) else None
    if saved is None and not tokenizer_file:
        raise DataError(f"{model_path}: no tokenizer was saved with it; pass --tokenizer")
    if not tokenizer_file and not os.path.isfile(saved["path"]):
        raise DataError(f"{model_path} was trained with the tokenizer {saved['path']}, which is not there (moved?); "
                        f"pass --tokenizer")
    tokenizer = Tokenizer(tokenizer_file or saved["path"])
    if saved is not None and saved["sha256"] != tokenizer.sha256:
        if os.path.realpath(tokenizer.model_file) == os.path.realpath(saved["path"]):
            raise DataError(f"{tokenizer.model_file} has changed since {model_path} was trained with it")
        raise DataError(f"{tokenizer.model_file} is not the tokenizer {model_path} was trained with "
                        f"({saved['path']}, SHA-256 {saved['sha256'][:12]}...)")
    return tokenizer


def train_tokenizer(files, vocab_size, model_prefix, alpha=0.5, max_sentences=1_000_000, seed=0, counts=None):
    """Train a unigram SentencePiece model (returns the .model path) on lines sampled with p_l ∝ n_l^alpha: language
    l gives round(M * p_l) lines (M: all lines, at most max_sentences), drawn at random from its files (repeated when
    it has fewer). vocab_size is a soft limit (a small corpus gives fewer pieces); 256 pieces are bytes that rare
    characters fall back to, and when the rest cannot hold every character, only the most frequent get their own.
    `counts`: line_counts of the files, where the caller has them (the corpus is not read again for them)."""
    if written := [f"{model_prefix}.{ext}" for ext in ("model", "vocab") if os.path.lexists(f"{model_prefix}.{ext}")]:
        raise DataError(f"{written[0]} exists: a tokenizer is not trained over it; remove it, or choose another name")
    if vocab_size < 300:  # (with fewer, too few characters are kept: at 263 and 264 SentencePiece's own error)
        raise DataError(f"vocab_size {vocab_size} leaves no room beside the 256 byte pieces; use at least 300")
    langs = corpus_files(files)
    lines = counts or line_counts([p for paths in langs.values() for p in paths])
    counts = {lang: sum(lines[p][0] for p in paths) for lang, paths in langs.items()}
    total = min(max_sentences, sum(counts.values()))
    rng = random.Random(seed)
    chars = collections.Counter()
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    sentences = []  # (handed to the trainer as a list: a generator's Ctrl-C would become the trainer's own error)
    for (lang, paths), p in zip(langs.items(), sampling_probabilities(counts, alpha).values()):
        repeats, rest = divmod(max(1, round(total * p)), counts[lang])
        reservoir, seen = [], 0  # Algorithm R: a uniform sample of `rest` lines, one pass
        for path in paths:
            with open(path, encoding="utf-8-sig") as f:
                for line in filter(None, (line.strip() for line in f)):
                    sentences += in_parts(line) * repeats
                    chars.update(line * repeats)
                    seen += 1
                    if len(reservoir) < rest:
                        reservoir.append(line)
                    elif (j := rng.randrange(seen)) < rest:
                        reservoir[j] = line
        sentences += [part for line in reservoir for part in in_parts(line)]
        chars.update("".join(reservoir))
    room = (vocab_size - 256 - 5) // 2  # SentencePiece needs a piece for every character it keeps
    if len(chars) > room:
        rare = {ord(c): " " for c, _ in chars.most_common()[room:]}
        sentences = [sentence.translate(rare) for sentence in sentences]
    # Into memory: SentencePiece's own files record the paths it read and wrote, and so would differ each time. On 2
    # threads on every machine: the trainer sums per thread, so their count would choose the model (as results/'s).
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type="unigram",
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=PAD, unk_piece=UNK, bos_piece=CLS, eos_piece=SEP,
            control_symbols=[MASK], byte_fallback=True, character_coverage=0.9995, hard_vocab_limit=False,
            input_sentence_size=0, max_sentence_length=1 << 16, num_threads=2, minloglevel=2)
    except RuntimeError as e:  # e.g. text that SentencePiece's normalization leaves blank
        raise DataError(f"{files}: SentencePiece could not train a tokenizer on it ({e})") from None
    trained = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{trained.id_to_piece(i)}\t{trained.get_score(i):g}\n" for i in range(trained.get_piece_size()))
    write_file(f"{model_prefix}.model", lambda out: out.write(model.getvalue()), "wb")  # (whole: the one writer)
    write_file(f"{model_prefix}.vocab", lambda out: out.write(vocab))  # (SentencePiece's own: piece<TAB>score lines)
    return f"{model_prefix}.model"


# The masked-LM stream: languages drawn by α-sampling (Appendix A.7), BERT's masking, packed rows

def sampling_probabilities(counts, alpha):
    """p_l ∝ n_l^alpha (Appendix A.7: alpha = 0.5; mBERT used 0.7): {language: probability}."""
    total = sum(n ** alpha for n in counts.values())
    return {lang: n ** alpha / total for lang, n in counts.items()}


def mask_tokens(ids, rng, tokenizer, max_predictions, masked_lm_prob=0.15):
    """create_pretraining_data.py's create_masked_lm_predictions on one [CLS] ... [SEP] sequence: returns
    (input ids with the masks applied, sorted masked positions, their original ids)."""
    ids = np.asarray(ids)
    to_predict = min(max_predictions, max(1, round(len(ids) * masked_lm_prob)))
    positions = np.sort(rng.choice(np.arange(1, len(ids) - 1), to_predict, replace=False))  # never [CLS]/[SEP]
    output = ids.copy()
    roll = rng.random(to_predict)
    output[positions[roll < 0.8]] = tokenizer.mask_id  # 80%: [MASK]; 0.8 <= roll < 0.9: unchanged
    replaced = positions[roll >= 0.9]  # 10%: a random ordinary piece
    output[replaced] = tokenizer.normal_ids[rng.integers(len(tokenizer.normal_ids), size=len(replaced))]
    return output, positions, ids[positions]


# Where a stream is in one language's share (a few ints per stream and language: the loader's state).
READER = np.dtype([(name, np.int64) for name in ("pass", "chunk", "doc", "line", "token", "any", "borrow")])
CACHED = 8  # chunks (and chunk orders) a stream keeps in memory, however many languages there are

# What every stream needs, the same in every process (picklable for DataLoader workers): [(language, [paths])],
# sorted; the languages' cumulative probabilities; {path: bytes}; the number of streams S; and the loader's settings.
_Corpus = collections.namedtuple("_Corpus", "langs cdf sizes streams seed shuffle_bytes")


class _Stream:
    """One slot of the global batch: rows of [CLS] ... [SEP], each from one language. `readers` (one READER
    record per language) and `seq` are views into the worker's state: all the stream needs to go on."""

    def __init__(self, corpus, stream, tokenizer, readers, seq):
        self.corpus, self.stream, self.tokenizer, self.readers, self.seq = corpus, stream, tokenizer, readers, seq
        self.cdf = corpus.cdf  # p_l ∝ n_l^alpha, summed (the draw in next_row)
        self.share = functools.cache(self._share)
        # The CACHED most recent chunk orders and chunks (documents shuffled): memory flat in the languages.
        self.chunk_order = functools.lru_cache(CACHED)(
            lambda lang, borrow, pass_: self._rng(lang, borrow, pass_).permutation(self.share(lang, borrow)[1]))
        self.chunk_docs = functools.lru_cache(CACHED)(self._chunk_docs)
        self.line_ids = self.line_key = None

    def _rng(self, *keys):
        return np.random.default_rng([self.corpus.seed, self.stream, *keys])

    def _share(self, lang, borrow):
        """Share (stream + borrow) % S of the language's files, [(path, first byte, end byte, chunks in the files
        before)], and its chunk count."""
        S, step = self.corpus.streams, self.corpus.shuffle_bytes
        s, parts, n = (self.stream + borrow) % S, [], 0
        for path in self.corpus.langs[lang][1]:
            first, end = self.corpus.sizes[path] * s // S, self.corpus.sizes[path] * (s + 1) // S
            parts.append((path, first, end, n))
            n += -(-(end - first) // step)
        return parts, n

    def _chunk_docs(self, lang, borrow, pass_, chunk):
        """The documents of the chunk-th chunk of the pass, in a random order."""
        k, step = int(self.chunk_order(lang, borrow, pass_)[chunk]), self.corpus.shuffle_bytes
        path, first, end, before = next(part for part in reversed(self.share(lang, borrow)[0]) if part[3] <= k)
        docs = read_chunk(path, first + (k - before) * step, min(first + (k - before + 1) * step, end),
                          self.corpus.sizes[path])
        return [docs[i] for i in self._rng(lang, borrow, pass_, chunk).permutation(len(docs))]

    def _take(self, lang, n):
        """Up to n pieces of the language's current line (fewer at its end); None when the pass over the share is
        over. The share is the stream's own, or when that holds no line (a language of fewer lines than streams)
        the one `borrow` streams further on."""
        st = self.readers[lang]
        while True:
            borrow, pass_ = int(st["borrow"]), int(st["pass"])
            while st["chunk"] < self.share(lang, borrow)[1]:  # the current chunk's documents (read again if evicted)
                docs = self.chunk_docs(lang, borrow, pass_, int(st["chunk"]))
                if st["doc"] < len(docs):
                    break
                st["chunk"], st["doc"], st["line"] = st["chunk"] + 1, 0, 0
            else:  # used up: the next pass, reshuffled
                if not st["any"]:  # the share gave no piece: read the next stream's
                    st["borrow"] += 1
                    if st["borrow"] >= self.corpus.streams:
                        raise DataError(f"{self.corpus.langs[lang][1][0]}: no text the tokenizer makes pieces of")
                st["pass"], st["chunk"], st["doc"], st["line"], st["token"], st["any"] = st["pass"] + 1, 0, 0, 0, 0, 0
                return None
            key = (lang, borrow, pass_, int(st["chunk"]), int(st["doc"]), int(st["line"]))
            if self.line_key != key:
                ids = self.tokenizer.encode(docs[st["doc"]][st["line"]])  # "[MASK]" may be [MASK] (user-defined)
                self.line_ids, self.line_key = [i for i in ids if i not in self.tokenizer.reserved], key
                st["any"] = st["any"] or len(self.line_ids) > 0
            if st["token"] < len(self.line_ids):
                piece = self.line_ids[st["token"]:st["token"] + n]
                st["token"] += len(piece)
                return piece
            st["line"], st["token"] = st["line"] + 1, 0
            if st["line"] >= len(docs[st["doc"]]):
                st["doc"], st["line"] = st["doc"] + 1, 0

    def next_row(self, length):
        """(a row of `length` ids: [CLS], pieces of one language, [SEP]; the rng that masks it)."""
        rng = self._rng(int(self.seq[0]), 1 << 30)
        self.seq[0] += 1
        lang = min(int(np.searchsorted(self.cdf, rng.random() * self.cdf[-1], side="right")), len(self.cdf) - 1)
        ids = [self.tokenizer.cls_id]
        while len(ids) < length - 1:
            ids += self._take(lang, length - 1 - len(ids)) or []
        return ids + [self.tokenizer.sep_id], rng


def _worker_steps(corpus, tokenizer, settings, worker, state):
    """The steps of one (rank, worker), forever, as (its grad_accum batches, its state after them, worker)."""
    batch_size, grad_accum, seq_len, max_predictions = settings
    streams = [_Stream(corpus, int(stream), tokenizer, state["readers"][j], state["seq"][j:j + 1])
               for j, stream in enumerate(state["ids"])]
    while True:
        batches = []
        for step_streams in (streams[a * batch_size:(a + 1) * batch_size] for a in range(grad_accum)):
            input_ids = np.empty((batch_size, seq_len), dtype=np.int64)
            positions, masked_ids = np.zeros((2, batch_size, max_predictions), dtype=np.int64)
            weights = np.zeros((batch_size, max_predictions), dtype=np.float32)
            for b, stream in enumerate(step_streams):
                row, rng = stream.next_row(seq_len)
                input_ids[b], pos, original = mask_tokens(row, rng, tokenizer, max_predictions)
                positions[b, :len(pos)], masked_ids[b, :len(pos)], weights[b, :len(pos)] = pos, original, 1.0
            batch = {"input_ids": input_ids, "token_type_ids": np.zeros_like(input_ids),
                     "attention_mask": np.ones_like(input_ids), "masked_positions": positions,
                     "masked_ids": masked_ids, "masked_weights": weights}
            batches.append({k: torch.from_numpy(v) for k, v in batch.items()})
        yield batches, {k: v.copy() for k, v in state.items()}, worker


class _WorkerStreams(torch.utils.data.IterableDataset):
    def __init__(self, corpus, tokenizer, settings, workers, states):
        self.corpus, self.tokenizer, self.settings = corpus, tokenizer, settings
        self.workers, self.states = workers, states

    def __iter__(self):
        p = getattr(torch.utils.data.get_worker_info(), "id", 0)  # (None in the main process: num_workers=0)
        try:
            yield from _worker_steps(self.corpus, self.tokenizer, self.settings, self.workers[p], self.states[p])
        except (DataError, OSError) as e:  # as it is: DataLoader would wrap it in the worker's traceback
            yield e, None, None


class MLMLoader:
    """The masked-LM stream of the module docstring: batches of `batch_size` rows, `grad_accum` of them per optimizer
    step. state_dict() between steps, load_state_dict() before iterating; `counts`: line_counts of the files."""

    def __init__(self, data, tokenizer, batch_size=32, seq_len=128, max_predictions=20, seed=0, rank=0,
                 world_size=1, grad_accum=1, num_workers=0, alpha=0.5, shuffle_bytes=1 << 14, counts=None):
        self.tokenizer, self.num_workers = tokenizer, num_workers
        langs = sorted(corpus_files(data).items())
        lines = counts or line_counts([p for _, paths in langs for p in paths])
        sizes = {p: os.path.getsize(p) for _, paths in langs for p in paths}
        lang_lines = {lang: sum(lines[p][0] for p in paths) for lang, paths in langs}
        self.probabilities = sampling_probabilities(lang_lines, alpha)
        workers, global_batch = max(num_workers, 1), batch_size * grad_accum * world_size
        cdf = np.cumsum(list(self.probabilities.values()))
        self.corpus = _Corpus(langs, cdf, sizes, workers * global_batch, seed, shuffle_bytes)
        self.settings = (batch_size, grad_accum, seq_len, max_predictions)
        # What a saved state must agree with: the files by name, size, lines and digest (not by path: a corpus may
        # move), and the global batch, not how processes and accumulation split it.
        files = [[lang, os.path.basename(p), sizes[p], *lines[p]] for lang, paths in langs for p in paths]
        self._fingerprint = {"files": files, "seed": seed, "global_batch": global_batch, "seq_len": seq_len,
                             "max_predictions": max_predictions, "num_workers": num_workers, "alpha": alpha,
                             "shuffle_bytes": shuffle_bytes}
        self._state = {"next_worker": 0, "workers": [
            {"ids": (w * global_batch + (np.arange(grad_accum)[:, None] * world_size + rank) * batch_size
                     + np.arange(batch_size)).ravel(),  # stream numbers, as the module's docstring gives them
             "seq": np.zeros(batch_size * grad_accum, dtype=np.int64),
             "readers": np.zeros((batch_size * grad_accum, len(langs)), dtype=READER)} for w in range(workers)]}

    def state_dict(self):
        """This process's streams, where they are."""
        workers = self._state["workers"]  # (READER records as plain int64s)
        return {"fingerprint": self._fingerprint, "next_worker": self._state["next_worker"], "streams": {
            k: torch.tensor(np.concatenate([w[k] for w in workers]).view(np.int64)) for k in ("ids", "seq", "readers")}}

    def load_state_dict(self, states, step=None):
        """A state_dict(), or the list of every process's: then any split of the same global batch over processes
        and accumulation continues it exactly (every stream goes on where it was). `step`: the steps it was saved
        after (a checkpoint's), which its row counters must count."""
        states = [states] if isinstance(states, dict) else states
        saved = states[0].get("fingerprint", {})
        differ = differences(saved, {key: value for key, value in self._fingerprint.items() if key != "files"})
        files = [(a, b) for a, b in itertools.zip_longest(saved.get("files", []), self._fingerprint["files"]) if a != b]
        if files:  # the first that differs
            differ.append(f"the corpus files (language, name, size, lines, SHA-256) {files[0][0]} then, "
                          f"{files[0][1]} now")
        if differ:
            raise DataError(f"the saved data-loader state was made with other data or settings: {'; '.join(differ)}")
        langs, S, seq_len = len(self.corpus.langs), self.corpus.streams, self.settings[2]
        if any(t.dtype != torch.int64 or t.shape[1:] != ((langs * len(READER),) if k == "readers" else ())
               for state in states for k, t in state["streams"].items()):
            raise DataError("the saved data-loader state is damaged: its streams are not state_dict()'s tensors")
        where = {int(i): (state["streams"], j) for state in states for j, i in enumerate(state["streams"]["ids"])}
        workers = [dict(w) for w in self._state["workers"]]  # (the loader's own once checked)
        for w in workers:
            if missing := [i for i in w["ids"] if i not in where]:
                raise DataError(f"the saved data-loader state has no stream {missing[0]} (not every process's state?)")
            w["seq"] = np.array([int(where[i][0]["seq"][where[i][1]]) for i in w["ids"]])
            w["readers"] = np.stack([where[i][0]["readers"][where[i][1]].numpy() for i in w["ids"]]).view(READER)
        next_worker = states[0]["next_worker"]  # (checked against the corpus and the run: docs/data.md says how)
        wrong = type(next_worker) is not int or not 0 <= next_worker < len(workers) or any(len(set(w["seq"])) != 1
                or not 0 <= w["seq"][0] == workers[-1]["seq"][0] + (k < next_worker) for k, w in enumerate(workers))
        for w in workers:
            r, shares = w["readers"], [_Stream(self.corpus, int(i), None, None, None).share for i in w["ids"]]
            most = {"borrow": S - 1, "any": 1, "pass": w["seq"][:, None] * (seq_len - 2) + r["borrow"], "chunk": [
                [share(k, b)[1] for k, b in enumerate(row.tolist())] for share, row in zip(shares, r["borrow"])]}
            wrong = wrong or any((r[f] < 0).any() or (r[f] > most.get(f, r[f])).any() for f in READER.names)
        if wrong:
            raise DataError(f"the saved data-loader state is damaged: its row counters, next_worker {next_worker!r} "
                            f"or positions are not those of a run on this corpus")
        if step is not None and (counted := int(workers[-1]["seq"][0]) * len(workers) + next_worker) != step:
            raise DataError(f"the saved data-loader state is damaged: its row counters count {counted} steps, not the "
                            f"{step} of its checkpoint")
        self._state = {"next_worker": next_worker, "workers": workers}

    def __iter__(self):
        st = self._state
        n = len(st["workers"])
        logical = [(st["next_worker"] + p) % n for p in range(n)]  # DataLoader asks worker 0, 1, ... in turn
        states = [{k: v.copy() for k, v in st["workers"][w].items()} for w in logical]
        # A generator of its own: DataLoader seeds its workers from it (they draw nothing), and torch's global one,
        # dropout's, stays untouched, so a resumed run draws the uninterrupted one's masks. collate_fn=tuple passes
        # each (batches, state, worker) on as made: a step's batches come from one worker, however split the batch.
        for batches, worker_state, w in torch.utils.data.DataLoader(
                _WorkerStreams(self.corpus, self.tokenizer, self.settings, logical, states), batch_size=None,
                num_workers=self.num_workers, collate_fn=tuple, generator=torch.Generator()):
            if isinstance(batches, Exception):
                raise batches
            yield from batches[:-1]
            st["workers"][w], st["next_worker"] = worker_state, (w + 1) % n  # (the step is taken with its last batch)
            yield batches[-1]


# Reading the corpus, checked where it enters: languages, line counts and digests, documents by byte range

def corpus_files(data):
    """{language: [paths]} from a file, a directory (its *.txt, and its folders') or a list of them."""
    if isinstance(data, dict):  # (not {language: files}: a file's language is its name)
        raise TypeError("corpus files: a file, a directory or a list of them, not a dict")
    langs = {}
    for path in map(str, [data] if isinstance(data, (str, os.PathLike)) else data):
        found = [path] if not os.path.isdir(path) else sorted(  # every file: none is left out unread
            p for p in glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True, include_hidden=True)
            if not os.path.isdir(p) or p.endswith(".txt"))
        if not found:
            raise DataError(f"{path}: no *.txt files in this directory or its folders")
        # A folder's file is read when its name is a language code (en, zh-Hant) up to the first dot, then *.txt
        # (a compressed one is refused below, by name); any other (JSON, a licence, a README) stops the run.
        if os.path.isdir(path) and (odd := [os.path.relpath(p, path) for p in found if not re.fullmatch(
                r"[a-z]{2,3}([-_][A-Za-z0-9]+)*(\..*)?\.txt(\.gz|\.bz2|\.xz|\.zst)?", os.path.basename(p))]):
            raise DataError(f"{path}: {', '.join(odd[:5])}{f' and {len(odd) - 5} more' * (len(odd) > 5)}: a corpus "
                            f"file's language is its name up to the first dot and its text plain *.txt (en.txt, "
                            f"de.2.txt), which these are not; move them out, or pass --data the files to read")
        for p in found:
            if os.path.basename(p).startswith("."):
                raise DataError(f"{p}: a corpus file's language is its name up to the first dot; this has none")
            if p.endswith((".gz", ".bz2", ".xz", ".zst")):
                raise DataError(f"{p}: a compressed file, which a stream cannot seek into for its share; decompress it")
            if p.endswith((".json", ".jsonl")):  # (mC4's and other corpora's form: their text is in a field)
                raise DataError(f"{p}: a JSON file; a corpus is plain text, one sentence per line")
            open_input(p, f"--data {p}").close()
            langs.setdefault(os.path.basename(p).split(".")[0], []).append(p)
    if not langs:
        raise DataError("no input files")
    return langs


def count_lines(path):
    """(non-blank lines, SHA-256) of a corpus file, in one pass that checks it: UTF-8, no NUL byte, a non-blank line."""
    lines = blank = size = 0
    digest = hashlib.sha256()
    with open_input(path) as f:
        while chunk := f.read(1 << 24):
            chunk += f.readline()  # whole lines
            digest.update(chunk)
            chunk = chunk.removeprefix(b"\xef\xbb\xbf" * (size == 0))  # (no BOM)
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lines + chunk.count(NEWLINE, 0, e.start) + 1}: not UTF-8") from None
            if (nul := chunk.find(b"\0")) >= 0:
                raise DataError(f"{path}:{lines + chunk.count(NEWLINE, 0, nul) + 1}: a NUL byte: not a text file")
            if chunk.count(b"\r") - chunk.count(b"\r\n") > chunk.count(NEWLINE):  # old Mac line ends, not a stray \r
                at = lines + chunk.count(NEWLINE, 0, re.search(rb"\r(?!\n)", chunk).start()) + 1
                raise DataError(f"{path}:{at}: lines that end in a carriage return alone: the file would be one line")
            # A chunk starts at a line start: "\n" + chunk puts a "\n" before each of its lines.
            blank += len(re.findall(rb"\n[ \t\r\f\v]*(?=\n|\Z)", NEWLINE + chunk)) - chunk.endswith(NEWLINE)
            size += len(chunk)
            lines += chunk.count(NEWLINE) + (not chunk.endswith(NEWLINE))
    if lines == blank:
        raise DataError(f"{path}: {'empty file' if size == 0 else 'only blank lines'}")
    return lines - blank, digest.hexdigest()


def line_counts(paths):
    """{path: (non-blank lines, SHA-256)}, the files read in parallel. The lines weigh the languages; the digests
    let a resumed run check that its corpus is the one it streamed (an edit that keeps size and lines too). Under
    64 MB, in this process: a worker process costs more to start (a spawned one imports torch: seconds)."""
    if sum(map(os.path.getsize, paths)) < 1 << 26:
        return {path: count_lines(path) for path in paths}
    with ProcessPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return dict(zip(paths, pool.map(count_lines, paths)))


def read_chunk(path, start, stop, size):
    """The lines of a file of `size` bytes that start in bytes [start, stop), as documents (lists of lines, split at
    blank lines; a document crossing `start` or `stop` is cut there; a line over MAX_LINE characters is read as
    several): the ranges of a partition of [0, size) shard a file with no line lost or repeated."""
    with open_input(path) as f:
        if os.fstat(f.fileno()).st_size != size:  # (the shares and the saved state are of that size)
            raise DataError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, {size} when this run counted its lines: "
                            f"changed while it was read; restore it, or start a new run")
        if start > 0:  # the line holding byte start - 1 belongs to the range before
            f.seek(start - 1)
            raw = f.read(stop - start + 1)  # (read once: the range is what follows that line's end)
            if (end := raw.find(b"\n")) < 0:  # (a long line's middle: not read to its end)
                return []
            begin, raw = start + end, raw[end + 1:]
        else:
            begin, raw = 0, f.read(stop)
        if begin >= stop:
            return []
        if not raw.endswith(b"\n"):
            raw += f.readline()  # the last line started before `stop`: it is ours, whole
    try:  # count_lines checked the file when it was counted; it may have changed since
        text = raw.decode("utf-8").removeprefix("\ufeff" if begin == 0 else "")  # a byte order mark
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: byte {begin + e.start}: not UTF-8 (changed since its lines were counted?)") from None
    blocks = re.split(r"\n[ \t\r\f\v]*\n[ \t\r\f\v\n]*", "\n" + text)  # at runs of blank lines
    blocks = [block.strip(" \t\n\r\f\v") for block in blocks]  # ASCII blanks, as count_lines counts them
    if len(text) <= MAX_LINE:  # (no line to cut: the common case, without a call per line)
        return [block.split("\n") for block in blocks if block]
    return [[part for line in block.split("\n") for part in in_parts(line)] for block in blocks if block]


def in_parts(line):
    """The line cut every MAX_LINE characters: a line of megabytes would be tokenized whole (and again whenever its
    stream comes back to it), and SentencePiece's trainer skips lines over 64 KiB without a word."""
    return [line[i:i + MAX_LINE] for i in range(0, len(line), MAX_LINE)]


# XTREME tasks: reading. Task files are UTF-8 (a leading byte order mark is dropped), lines end in "\n" or
# "\r\n", and are split on those only: a sentence may hold U+001C, which str.splitlines() would break on.

@dataclass
class PairExample:
    sentence1: str
    sentence2: str
    label: str  # None in a file without labels
    source: str  # "file:line", for error messages
    language: str = None  # from a `language` column (XNLI 1.0's own files)


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

    @property
    def answered(self):
        """Whether it has gold answers and none is blank (which an empty prediction would match)."""
        return bool(self.answers) and all(a["text"].strip() for a in self.answers)


def check_label(label, labels, source):
    if label not in labels:
        raise DataError(f"{source}: unknown label {label!r}; expected one of {', '.join(labels)}")


def read_pairs(path, labels=None, labelled=False):
    """XNLI / PAWS-X sentence pairs. XTREME's TSV (sentence1<TAB>sentence2<TAB>label, no header, written by
    Python's csv module: a field holding a quote is quoted, its quotes doubled) or, with a header row, the
    original releases (XNLI 1.0's language/gold_label/.../sentence1/sentence2, XNLI-MT's premise/hypo/label,
    PAWS-X's id/sentence1/sentence2/label; quotes are plain characters there). A file without labels (two
    columns, or a header without one) is refused when labelled=True; `labels`, the task's label set, checks them."""
    text = read_text(path)
    header = text.split("\n", 1)[0].split("\t")
    columns = None
    if {"label", "gold_label", "sentence1", "premise"} & set(header):
        names = [("sentence1", "premise"), ("sentence2", "hypo"), ("gold_label", "label"), ("language",)]
        columns = [next((header.index(n) for n in alternatives if n in header), None) for alternatives in names]
        needed = 3 if labelled or {"label", "gold_label"} & set(header) else 2  # the label's column, if due
        if None in columns[:needed]:
            raise DataError(f"{path}:1: a header without sentence1/premise, sentence2/hypo and label columns: {header}")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", strict=True,
                        quoting=csv.QUOTE_NONE if columns else csv.QUOTE_MINIMAL)
    rows, line = [], 1
    try:
        for row in reader:
            rows.append((f"{path}:{line}", row))  # the line where the row starts
            line = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"{path}:{line}: {e} (a quote never closed?)") from None
    # With a label on any line (or labelled=True), every line needs one.
    width = len(header) if columns else 3 if labelled or any(len(row) == 3 for _, row in rows) else 2
    examples = []
    for where, row in rows[1:] if columns else rows:
        if any("\n" in f for f in row):
            raise DataError(f"{where}: a quoted field runs over several lines (a quote never closed?)")
        if len(row) != width:
            expected = "the header's" if columns else "sentence1<TAB>sentence2" + "<TAB>label" * (width == 3)
            raise DataError(f"{where}: {len(row)} tab-separated fields; expected {width}: {expected}")
        row = [None if i is None else row[i] for i in columns] if columns else row + [None] * (4 - len(row))
        if not (row[0].strip() and row[1].strip()):
            raise DataError(f"{where}: a blank sentence{1 + bool(row[0].strip())}; a pair needs two sentences")
        label = LABEL_ALIASES.get(row[2], row[2])
        if labels is not None and label is not None:
            check_label(label, labels, where)
        examples.append(PairExample(row[0], row[1], label, where, row[3]))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def read_tagging(path, labels=None, labelled=False, spaces=True):
    """PAN-X / UD-POS: token<TAB>label lines, a blank line between sentences. A file without labels (tokens
    alone) is refused when labelled=True; spaces=False refuses a token holding a space (PAN-X's never do;
    UD's Vietnamese words do). The raw XTREME files prefix every token with its language ("en:Paris");
    when all tokens share one such prefix, it is removed."""
    lines = read_text(path).split("\n")
    width = 2 if labelled or any("\t" in line for line in lines) else 1  # a label on any line: on every line
    # The sentences: runs of lines not blank (a token may be U+00A0 or U+3000, which str.strip() would remove).
    runs = itertools.groupby(enumerate(lines, 1), key=lambda numbered: numbered[1].strip(" \t") != "")
    sentences = [[(number, line.split("\t")) for number, line in run] for filled, run in runs if filled]
    for number, fields in itertools.chain(*sentences):
        if len(fields) != width or not fields[0]:
            found = "an empty token" if len(fields) == width else f"{len(fields)} tab-separated fields"
            raise DataError(f"{path}:{number}: {found}; expected {'token<TAB>label' if width == 2 else 'a token'}")
        if not spaces and " " in fields[0]:
            raise DataError(f"{path}:{number}: the token {fields[0][:40]!r} holds a space; expected one token "
                            f"per line{' and its label' if width == 2 else ''}")
        if labels is not None and width == 2:
            check_label(fields[1], labels, f"{path}:{number}")
    prefixes = {(re.match(r"[a-z]{2,3}:", f[0]) or [None])[0] for s in sentences for _, f in s}
    cut = len(next(iter(prefixes))) if len(prefixes) == 1 and None not in prefixes else 0
    return [TaggingExample([f[0][cut:] for _, f in s], [f[1] for _, f in s] if width == 2 else None,
                           f"{path}:{s[0][0]}") for s in sentences]


def read_squad(path, check_answers=True):
    """SQuAD v1.1 JSON (XQuAD, MLQA, TyDiQA-GoldP): one example per question, its structure checked, every
    question id once, and (check_answers) every answer found at its answer_start in the context."""
    text = read_text(path)
    try:
        articles = json.loads(text)["data"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # (ValueError: JSONDecodeError, 5,000 digits)
        raise DataError(f"{path}: not SQuAD-format JSON (a top-level \"data\" list) ({e})") from None
    _expect(isinstance(articles, list), f'{path}: "data"', "list of articles")
    examples, seen = [], set()
    for a, article in enumerate(articles):
        where = f"{path}: data[{a}]"
        _expect(isinstance(article, dict) and isinstance(article.get("paragraphs"), list), where, '"paragraphs" list')
        for p, paragraph in enumerate(article["paragraphs"]):
            where = f"{path}: data[{a}].paragraphs[{p}]"
            _expect(isinstance(paragraph, dict) and isinstance(paragraph.get("context"), str)
                    and isinstance(paragraph.get("qas"), list), where, '"context" string and a "qas" list')
            context = paragraph["context"]
            for q, qa in enumerate(paragraph["qas"]):
                where = f"{path}: data[{a}].paragraphs[{p}].qas[{q}]"
                _expect(isinstance(qa, dict) and isinstance(qa.get("id"), str) and qa["id"], where, '"id" string')
                where = f"{path}: question {qa['id']!r}"
                if qa["id"] in seen:
                    raise DataError(f"{where}: this id is used twice (scores are kept by id)")
                seen.add(qa["id"])
                _expect(isinstance(qa.get("question"), str), where, '"question" string')
                _expect(isinstance(answers := qa.get("answers", []), list), where, '"answers" list')
                for answer in answers:
                    start = answer.get("answer_start") if isinstance(answer, dict) else None
                    _expect(type(start) is int and start >= 0 and isinstance(answer.get("text"), str), where,
                            'answers of {"text": string, "answer_start": integer >= 0}')  # (True is no integer)
                    found = context[start:start + len(answer["text"])]
                    if check_answers and found != answer["text"]:
                        raise DataError(f"{where}: answer {answer['text']!r} is not at answer_start {start} of "
                                        f"the context (found {found!r})")
                texts = [qa["id"], qa["question"], context, *(answer["text"] for answer in answers)]
                if any(re.search("[\ud800-\udfff]", text) for text in texts):  # JSON may escape one: "\\ud83d"
                    raise DataError(f"{where}: its text holds a lone UTF-16 surrogate (half of a pair), no character")
                examples.append(SquadExample(qa["id"], qa["question"], context, answers, a, where))
    if not examples:
        raise DataError(f"{path}: no questions")
    return examples


def _expect(ok, where, what):
    if not ok:
        raise DataError(f"{where}: needs a {what}")

