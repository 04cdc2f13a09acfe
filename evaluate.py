r"""Evaluation for "Rethinking Embedding Coupling in Pre-trained Language Models" (Chung et al., ICLR 2021).

The paper fine-tunes on English and evaluates zero-shot on the XTREME tasks (Section 3, Tables 2-7). This file
holds their official metrics, re-implemented to give the official scripts' figures to the last digit (in percent):

  xnli, pawsx          accuracy
  panx                 entity-level precision / recall / F1 of seqeval (XTREME's evaluate.py)
  udpos                the same seqeval F1 over part-of-speech tags, as XTREME reports it; token accuracy too
  xquad, tydiqa        exact match / F1 of the SQuAD v1.1 script (evaluate-v1.1.py, XTREME's evaluate_squad.py)
  mlqa                 exact match / F1 of the MLQA script (mlqa_evaluation_v1.py): per-language normalization

`python finetune.py predict` writes the prediction files that `score` reads:
  python evaluate.py score --task xquad --gold data/xquad/xquad.de.json --predictions pred.json
  python evaluate.py score --task mlqa --lang zh --gold dev-context-zh-question-zh.json --predictions pred.json
  python evaluate.py mlm-accuracy --checkpoint out/pretrain/ckpt-00000800 --data held_out.txt
  python evaluate.py translation-probe --checkpoint out/pretrain/ckpt-00000800  # XQuAD en -> de
"""

import contextlib
import itertools
import json
import re
import string
import sys
import unicodedata
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

import data
from configs import (DEVICE, GIVEN, POSITIVE, SEED, at_least, check_flags, flag, one_of, parse_command_line,
                     run_script)
from checkpoints import DataError, from_checkpoint, from_hf, read_json
from model import Encoder, MaskedLM
from runtime import setup_runtime

TASKS = ("xnli", "pawsx", "panx", "udpos", "xquad", "mlqa", "tydiqa")
# The label sets, in the order of the task heads' outputs (finetune.py).
CLASSIFICATION_LABELS = {"xnli": ("contradiction", "entailment", "neutral"), "pawsx": ("0", "1")}
TAGGING_LABELS = {
    "panx": ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"),
    # The 17 Universal Dependencies v2 part-of-speech tags.
    "udpos": ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON", "PROPN",
              "PUNCT", "SCONJ", "SYM", "VERB", "X"),
}


def squad_normalize(text):
    """SQuAD v1.1: lower case, drop ASCII punctuation, drop the English articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


# TyDiQA-GoldP's own dev file holds 11 languages; its question ids begin with the language's name.
TYDI_LANGUAGES = {"arabic": "ar", "bengali": "bn", "english": "en", "finnish": "fi", "indonesian": "id",
                  "japanese": "ja", "korean": "ko", "russian": "ru", "swahili": "sw", "telugu": "te", "thai": "th"}
MLQA_ARTICLES = {
    "en": r"\b(a|an|the)\b",
    "es": r"\b(un|una|unos|unas|el|la|los|las)\b",
    "hi": None,  # no articles
    "vi": r"\b(của|là|cái|chiếc|những)\b",
    "de": r"\b(ein|eine|einen|einem|eines|einer|der|die|das|den|dem|des)\b",
    # Verbatim from the official script. "^" after text can never match, so in effect every "ال"
    # (the article, but also the same two letters anywhere inside a word) becomes a space.
    "ar": "\\sال^|ال",
    "zh": None,
}
MLQA_LANGUAGES = tuple(MLQA_ARTICLES)


def mlqa_normalize(text, lang):
    """MLQA v1: lower case, drop Unicode punctuation, drop the language's articles, re-tokenize (Chinese:
    character-level for ideographs) and join the tokens with single spaces. qa_scores checks `lang`."""
    # The official script's punctuation: {every char of a Unicode "P*" category} | string.punctuation.
    text = "".join(ch for ch in text.lower() if not unicodedata.category(ch).startswith("P")
                   and ch not in string.punctuation)
    if MLQA_ARTICLES[lang]:
        text = re.sub(MLQA_ARTICLES[lang], " ", text)
    if lang == "zh":  # the script's mixed_segmentation: each ideograph a token (its punctuation is gone by now)
        return " ".join(re.findall(r"[\u4e00-\u9fa5]|[^\s\u4e00-\u9fa5]+", text))
    return " ".join(text.split())


def _token_f1(prediction_tokens, gold_tokens):
    num_same = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_scores(dataset, predictions, lang=None):
    """Exact match and F1 (percent) of {question id: answer text} predictions against a SQuAD-format dataset
    (the JSON's "data" list). lang=None: SQuAD v1.1 normalization (XQuAD, TyDiQA-GoldP); lang="de" etc.:
    MLQA's. A question without a prediction scores 0 (reported on stderr, as the official scripts do);
    predictions for ids not in the dataset are ignored, as there, and counted in "ignored_predictions"."""
    if lang is not None and lang not in MLQA_LANGUAGES:
        raise DataError(f"MLQA has no normalization for language {lang!r}; choose one of {MLQA_LANGUAGES}")
    normalize = squad_normalize if lang is None else (lambda text: mlqa_normalize(text, lang))
    qas = [qa for article in dataset for paragraph in article["paragraphs"] for qa in paragraph["qas"]]
    if not qas:
        raise DataError("the gold dataset has no questions")
    exact_match = f1 = unanswered = 0
    for qa in qas:
        if qa["id"] not in predictions:
            print(f"Unanswered question {qa['id']} will receive score 0.", file=sys.stderr)
            unanswered += 1
            continue
        prediction = normalize(predictions[qa["id"]])
        golds = [normalize(answer["text"]) for answer in qa["answers"]]
        exact_match += max(prediction == gold for gold in golds)
        f1 += max(_token_f1(prediction.split(), gold.split()) for gold in golds)
    return {"exact_match": 100.0 * exact_match / len(qas), "f1": 100.0 * f1 / len(qas), "total": len(qas),
            "unanswered": unanswered, "ignored_predictions": len(set(predictions) - {qa["id"] for qa in qas})}


def entities(tags):
    """Chunks (type, first, last) of a tag sequence, found as seqeval's default mode finds them (XTREME's
    evaluate.py scores panx and udpos with seqeval): a tag's first character is its prefix, what follows its
    first "-" its type. For IOB tags that is conlleval's reading: a chunk ends before B-, O or a change of type,
    and an I- after O or after another type starts one. Part-of-speech tags read the same way ("NOUN": prefix N,
    type "OUN"), so a run of one tag is one chunk, and "SCONJ" or "SYM" (prefix S) a chunk of one token."""
    chunks = []
    prev_tag, prev_type, start = "O", "", 0
    for i, label in enumerate(list(tags) + ["O"]):
        tag, type_ = label[0], label[1:].split("-", 1)[-1] or "_"
        if (prev_tag in "ES" or (prev_tag in "BI" and tag in "BSO")
                or (prev_tag not in "O." and prev_type != type_)):
            chunks.append((prev_type, start, i - 1))
        if tag in "BS" or (prev_tag in "ESO" and tag in "EI") or (tag not in "O." and prev_type != type_):
            start = i
        prev_tag, prev_type = tag, type_
    return chunks


def ner_scores(gold, predicted):
    """Precision / recall / F1 (percent) over sentences of tags, computed as seqeval and XTREME do: the
    sentences joined with an "O" between them, a chunk correct only when its type and both boundaries match."""
    if len(gold) != len(predicted):
        raise DataError(f"{len(gold)} gold sentences but {len(predicted)} predicted")
    for s, (g, p) in enumerate(zip(gold, predicted)):
        if len(g) != len(p):
            raise DataError(f"sentence {s}: {len(g)} gold tags but {len(p)} predicted")
    joined = ([tag for tags in sentences for tag in [*tags, "O"]] for sentences in (gold, predicted))
    gold_entities, predicted_entities = (set(entities(tags)) for tags in joined)
    correct = len(gold_entities & predicted_entities)
    precision = correct / len(predicted_entities) if predicted_entities else 0.0
    recall = correct / len(gold_entities) if gold_entities else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {"precision": precision * 100, "recall": recall * 100, "f1": f1 * 100, "gold_entities": len(gold_entities),
            "predicted_entities": len(predicted_entities), "correct_entities": correct}


def pos_scores(gold, predicted):
    """XTREME's udpos figure, seqeval's F1 over part-of-speech tags (ner_scores), and token accuracy."""
    return {**ner_scores(gold, predicted), **accuracy(list(itertools.chain(*gold)), list(itertools.chain(*predicted)))}


def accuracy(gold, predicted):
    if len(gold) != len(predicted):
        raise DataError(f"{len(gold)} gold labels but {len(predicted)} predicted")
    if not gold:
        raise DataError("no examples to score")
    correct = sum(g == p for g, p in zip(gold, predicted))
    return {"accuracy": correct / len(gold) * 100, "correct": correct, "total": len(gold)}


def print_table(title, table, log):
    """A per-language table {language: {metric: value}}, one row each (the last: the average), through log."""
    metrics = list(next(iter(table.values())))
    log(title)
    log(f"{'lang':<10}" + "".join(f"{m:>14}" for m in metrics))
    for lang, row in table.items():
        log(f"{lang:<10}" + "".join(f"{row[m]:>14.2f}" for m in metrics))


def task_scores(task, examples, predictions, lang=None):
    """The task's official figures (percent) for the examples data.py read from a gold file and predictions:
    a label (xnli, pawsx) or a tag list (panx, udpos) per example, or {question id: answer text} (QA)."""
    if task in CLASSIFICATION_LABELS:
        return accuracy([e.label for e in examples], predictions)
    if task in TAGGING_LABELS:
        gold = [e.labels for e in examples]
        return ner_scores(gold, predictions) if task == "panx" else pos_scores(gold, predictions)
    dataset = [{"paragraphs": [{"qas": [{"id": e.id, "answers": e.answers} for e in examples]}]}]
    return qa_scores(dataset, predictions, lang if task == "mlqa" else None)


def check_mlqa_language(lang, path, said):
    """MLQA normalizes answers in the language of the contexts: `lang` must be one of MLQA's and the one that
    an MLQA file's name gives its contexts (dev-context-de-question-en.json: de). `said`: where lang came from."""
    if lang not in MLQA_LANGUAGES:
        raise DataError(f"{said} must be one of {', '.join(MLQA_LANGUAGES)} for mlqa (its answer normalization "
                        f"depends on the language), got {lang!r}")
    named = re.search(r"context-([a-z]{2})-question", Path(path).name)
    if named and named[1] != lang:
        raise DataError(f"{said} is {lang}, but {path} holds MLQA's {named[1]} contexts: answers are normalized in "
                        f"the context's language, {named[1]}")


def score_files(task, gold_path, predictions_path, lang=None):
    """The task's figures for a prediction file against its gold file. A gold file with a language column
    (XNLI 1.0's own) adds each language's accuracy under "languages"."""
    for name, path in (("--gold", gold_path), ("--predictions", predictions_path)):  # named by flag, before reading
        data.open_input(path, f"{name} {path}").close()
    if task in CLASSIFICATION_LABELS:
        gold = data.read_pairs(gold_path, CLASSIFICATION_LABELS[task], labelled=True)
        predicted = data.read_text(predictions_path).removesuffix("\n").split("\n")  # one label per line
        for line, label in enumerate(predicted, 1):
            data.check_label(label, CLASSIFICATION_LABELS[task], f"{predictions_path}:{line}")
        if len(gold) != len(predicted):
            raise DataError(f"{gold_path} has {len(gold)} examples but {predictions_path} has {len(predicted)} labels")
        result = task_scores(task, gold, predicted)
        for lang in sorted({e.language for e in gold if e.language}):
            pairs = [(e.label, p) for e, p in zip(gold, predicted) if e.language == lang]
            result.setdefault("languages", {})[lang] = accuracy(*zip(*pairs))["accuracy"]
        return result
    if task in TAGGING_LABELS:
        gold, predicted = (data.read_tagging(path, TAGGING_LABELS[task], labelled=True, spaces=task != "panx")
                           for path in (gold_path, predictions_path))
        if len(gold) != len(predicted):
            raise DataError(f"{gold_path} has {len(gold)} sentences but {predictions_path} has {len(predicted)}")
        for g, p in zip(gold, predicted):
            if g.tokens != p.tokens:
                raise DataError(f"the sentence at {g.source} has other tokens in {predictions_path} ({p.source})")
        return task_scores(task, gold, [p.labels for p in predicted])
    if task == "mlqa":
        check_mlqa_language(lang, gold_path, "--lang")
    gold = data.read_squad(gold_path, check_answers=False)  # the official scripts read only the answers' text
    if unanswerable := [e.id for e in gold if not e.answered]:
        raise DataError(f"{gold_path}: question {unanswerable[0]!r} has no gold answer to score against, or a blank "
                        f"one, which an empty prediction would match (answers removed, as in XTREME's test files?)")
    predictions = read_json(predictions_path)
    if not isinstance(predictions, dict) or not all(isinstance(v, str) for v in predictions.values()):
        raise DataError(f"{predictions_path}: expected a JSON object {{question id: answer text}}")
    if not predictions.keys() & {e.id for e in gold}:  # (answers to some: the official scripts score them)
        raise DataError(f"{predictions_path}: answers none of the questions of {gold_path} (another file's answers?)")
    return task_scores(task, gold, predictions, lang)


def mlm_accuracy(model, batches, device="cpu"):
    """Masked-LM accuracy (percent) and mean cross-entropy over the masked positions of `batches`, dicts as
    data.MLMLoader yields them (masked_weights 0 marks padding predictions). Table 8 of the paper."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, summed loss, predictions
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits, loss = model(**batch)  # (B*P, V), the mean cross-entropy of the batch's predictions
            weights = batch["masked_weights"].flatten().double()
            correct = ((logits.argmax(-1) == batch["masked_ids"].flatten()).double() * weights).sum()
            totals += torch.stack([correct, loss.double() * weights.sum(), weights.sum()])
    correct, loss, count = totals.tolist()  # the one host sync, after the loop
    if count == 0:
        raise DataError("no masked positions to score")
    return {"accuracy": 100.0 * correct / count, "loss": loss / count, "predictions": round(count)}


def sentence_embeddings(encoder, sentences, cls_id, sep_id, pad_id, max_len=128, batch_size=32, device="cpu"):
    """One vector per sentence and layer: the mean of the sentence's token states without [CLS], [SEP] and
    padding. `sentences` are token-id lists (truncated to max_len - 2). Returns num_layers + 1 tensors
    (N, H): the embedding output (after the E_in -> H projection), then each layer's output."""
    sentences = [ids[:max_len - 2] for ids in sentences]
    if not all(sentences):
        raise DataError(f"sentence {[bool(ids) for ids in sentences].index(False)} has no tokens")
    encoder.eval()
    batch_size = min(batch_size, len(sentences))  # (padding to a larger batch would be work for nothing)
    padded = sentences + [sentences[0]] * (-len(sentences) % batch_size)  # full batches: one shape for every step
    input_ids = torch.tensor([[cls_id, *ids, sep_id] + [pad_id] * (max_len - len(ids) - 2) for ids in padded])
    attention_mask = torch.tensor([[1] * (len(ids) + 2) + [0] * (max_len - len(ids) - 2) for ids in padded])
    own = torch.tensor([[0.0] + [1.0] * len(ids) + [0.0] * (max_len - len(ids) - 1) for ids in padded])  # (N, T)
    per_batch = []
    with torch.no_grad():
        for ids, mask, weights in zip(*(t.split(batch_size) for t in (input_ids, attention_mask, own))):
            _, states = encoder(ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            weights = weights.to(device).unsqueeze(-1)  # the sentence's own tokens: 1, (B, T, 1)
            per_batch.append([((h.float() * weights).sum(1) / weights.sum(1)).cpu() for h in states])
    return [torch.cat(layer)[:len(sentences)] for layer in zip(*per_batch)]


def translation_accuracy(source, target, fit, test, same=None):
    """Nearest-neighbour translation accuracy (percent) of one layer (Figure 2's method): the translation
    vector is the mean of target - source over the `fit` pairs; each `test` source plus that vector
    retrieves its nearest `test` target by L2 distance, and is right when that is its own translation, or
    a target with the same text (`same[i]`: the first pair whose target is pair i's; it has the same vector)."""
    translation = (target[fit] - source[fit]).double().mean(0)
    distances = torch.cdist(source[test].double() + translation, target[test].double())  # (n_test, n_test)
    answers = torch.arange(len(target)) if same is None else torch.as_tensor(same)
    hits = answers[test][distances.argmin(1)] == answers[test]
    return 100.0 * hits.double().mean().item()


def translation_probe(encoder, source, target, cls_id, sep_id, pad_id, max_len=128, batch_size=32, seed=0,
                      device="cpu"):
    """Per-layer translation accuracy (percent, a list of num_layers + 1) between parallel token-id lists.
    The pairs are split at random (seeded) into two halves: the translation vector is fitted on one and the
    accuracy measured on the other, so the vector never saw the pairs it retrieves."""
    if len(source) < 4:
        raise DataError(f"the probe needs at least 4 sentence pairs, got {len(source)}")
    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(seed))
    fit, test = order[:len(order) // 2], order[len(order) // 2:]
    embed = lambda sentences: sentence_embeddings(encoder, sentences, cls_id, sep_id, pad_id, max_len,
                                                  batch_size, device)
    first = {}  # a repeated target sentence (XQuAD repeats a few questions): any of its copies is the answer
    same = [first.setdefault(tuple(ids[:max_len - 2]), i) for i, ids in enumerate(target)]
    return [translation_accuracy(s, t, fit, test, same) for s, t in zip(embed(source), embed(target))]


def read_parallel(source_path, target_path, unit="questions"):
    """Parallel sentences: two SQuAD-format JSON files (XQuAD: the same question ids in every language), paired
    by question id or (unit="contexts") by their paragraphs' question ids; or two line-parallel text files."""
    if (Path(source_path).suffix == ".json") != (Path(target_path).suffix == ".json"):
        raise DataError(f"{source_path} and {target_path}: two SQuAD-format .json files, or two text files")
    if Path(source_path).suffix != ".json" and unit == "contexts":
        raise DataError(f"{source_path}: --unit contexts pairs the paragraphs of SQuAD-format .json files")
    sides = []
    for path in (source_path, target_path):
        if Path(source_path).suffix != ".json":
            text = data.read_text(path)
            with contextlib.suppress(json.JSONDecodeError, RecursionError):  # not JSON: text, as it should be
                if isinstance(json.loads(text, parse_int=str), (dict, list)):  # (str: 5,000 digits convert too)
                    raise DataError(f"{path}: a JSON file; SQuAD-format files are read as such when named *.json")
            lines = text.removesuffix("\n").split("\n")
            bad = next((i for i, line in enumerate(lines, 1) if not line.strip() or "\t" in line), 0)
            if bad:
                what = "a tab: one sentence per line, not columns" if lines[bad - 1].strip() else "empty line"
                raise DataError(f"{path}:{bad}: {what}")
            sides.append(dict(enumerate(lines)))
        elif unit == "contexts":
            groups = itertools.groupby(data.read_squad(path, check_answers=False), key=lambda e: (e.article, e.context))
            sides.append({tuple(e.id for e in group): context for (_, context), group in groups})
        else:
            sides.append({e.id: e.question for e in data.read_squad(path, check_answers=False)})
    if sides[0].keys() != sides[1].keys():
        raise DataError(f"{source_path} and {target_path} are not parallel: {len(sides[0])} and {len(sides[1])} "
                        f"sentences, or other question ids")
    return list(sides[0].values()), [sides[1][key] for key in sides[0]]


@dataclass
class ScoreConfig:
    """score a prediction file against a gold file; prints one JSON object (figures in percent)"""
    task: str = flag("", f"one of {', '.join(TASKS)}", one_of(TASKS))
    gold: str = flag("", "xnli/pawsx: the task's TSV; panx/udpos: token<TAB>label; xquad/mlqa/tydiqa: SQuAD-format "
                         "JSON", GIVEN)
    predictions: str = flag("", "xnli/pawsx: one label per line; panx/udpos: token<TAB>label; QA: JSON "
                                "{question id: answer text}", GIVEN)
    lang: str = flag("", f"the language; mlqa needs it ({', '.join(MLQA_LANGUAGES)}: its answer normalization), "
                         f"other tasks only echo it")

    __post_init__ = check_flags


@dataclass
class MLMAccuracyConfig:
    """masked-LM accuracy on held-out text (Table 8); prints one JSON object"""
    checkpoint: str = flag("", "a pretrain.py checkpoint or a Hugging Face RemBERT dir", GIVEN)
    data: str = flag("", "held-out text: a file or a directory of *.txt (as pretrain.py)", GIVEN)
    tokenizer: str = flag("", "SentencePiece model (default: the checkpoint's)")
    batches: int = flag(50, "batches of the masked-LM stream to score: drawn as pre-training draws them (languages "
                            "by p ∝ n^0.5; text that runs out is read again, masked anew)", POSITIVE)
    seq_len: int = flag(128, "tokens per sequence", at_least(3))
    max_predictions: int = flag(20, "masked positions per sequence", POSITIVE)
    batch_size: int = flag(32, "sequences per batch", POSITIVE)
    seed: int = flag(0, "seed of the masking and sampling", SEED)
    device: str = flag("auto", "auto | cpu | cuda | xla", DEVICE)

    def __post_init__(self):
        check_flags(self)
        if self.max_predictions > self.seq_len - 2:  # the positions between [CLS] and [SEP]; more are padding
            raise ValueError(f"--max-predictions must be at most --seq-len - 2 ({self.seq_len - 2})")


@dataclass
class ProbeConfig:
    """per-layer nearest-neighbour translation accuracy (Figure 2's method)"""
    checkpoint: str = flag("", "a pretrain.py checkpoint or a Hugging Face RemBERT dir", GIVEN)
    tokenizer: str = flag("", "SentencePiece model (default: the checkpoint's)")
    source: str = flag("data/xquad/xquad.en.json", "source sentences: SQuAD-format JSON (XQuAD: docs/data.md says "
                                                  "where to get it), or a text file line-parallel to --target")
    target: str = flag("data/xquad/xquad.de.json", "target sentences, parallel")
    unit: str = flag("questions", "JSON: pair the questions (by id) or the contexts", one_of(("questions", "contexts")))
    max_len: int = flag(128, "tokens per sentence, with [CLS] and [SEP]", at_least(3))
    batch_size: int = flag(32, "sentences per batch", POSITIVE)
    seed: int = flag(0, "seed of the fit/test split of the pairs", SEED)
    device: str = flag("auto", "auto | cpu | cuda | xla", DEVICE)

    def __post_init__(self):
        check_flags(self)
        for name, path in (("--source", self.source), ("--target", self.target)):  # before a model is read
            data.open_input(path, f"{name} {path} (XQuAD: docs/data.md says where to get it)").close()


def main(argv=None):
    command, cfg = parse_command_line(__doc__, {"score": ScoreConfig, "mlm-accuracy": MLMAccuracyConfig,
                                                "translation-probe": ProbeConfig}, argv)
    if command == "score":
        print(json.dumps({"task": cfg.task, "lang": cfg.lang or None,
                          **score_files(cfg.task, cfg.gold, cfg.predictions, cfg.lang or None)}))
        return
    device = setup_runtime(cfg.device).device
    cls = MaskedLM if command == "mlm-accuracy" else Encoder  # the probe's: no head is built (RemBERT's: 416M weights)
    read = from_hf if (Path(cfg.checkpoint) / "config.json").is_file() else from_checkpoint
    with warnings.catch_warnings():  # a directory without a masked-LM head: no Table 8; the probe uses no pooler
        warnings.filterwarnings("error" if command == "mlm-accuracy" else "ignore", ".*has no (masked-LM head|pooler)")
        try:
            model = read(cfg.checkpoint, cls)
        except UserWarning as e:
            raise DataError(f"{e}; there is no masked-LM accuracy to measure") from None
    tokenizer = data.tokenizer_for(cfg.checkpoint, cfg.tokenizer)
    length = cfg.seq_len if command == "mlm-accuracy" else cfg.max_len
    if tokenizer.vocab_size > model.config.vocab_size or length > model.config.max_position_embeddings:
        raise DataError(f"{tokenizer.model_file} ({tokenizer.vocab_size} pieces) or the length {length} does not fit "
                        f"{cfg.checkpoint} (vocab_size {model.config.vocab_size}, "
                        f"{model.config.max_position_embeddings} positions)")
    if command == "mlm-accuracy":
        loader = data.MLMLoader(cfg.data, tokenizer, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                max_predictions=cfg.max_predictions, seed=cfg.seed)
        print(json.dumps({"checkpoint": cfg.checkpoint, "data": cfg.data,
                          **mlm_accuracy(model.to(device), itertools.islice(loader, cfg.batches), device)}))
        return
    source, target = read_parallel(cfg.source, cfg.target, cfg.unit)
    ids = [[tokenizer.encode(t) for t in side] for side in (source, target)]
    if cut := sum(len(sentence) > cfg.max_len - 2 for side in ids for sentence in side):
        warnings.warn(f"{cut} of the {2 * len(source)} sentences have more pieces than --max-len {cfg.max_len} holds "
                      f"with [CLS] and [SEP]: each is cut there, and a pair may then not say the same")
    for path, texts, side in zip((cfg.source, cfg.target), (source, target), ids):
        if not all(side):
            raise DataError(f"{path}: the sentence {texts[side.index([])]!r} has no pieces in {tokenizer.model_file}")
    accuracies = translation_probe(model.to(device), *ids, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id,
                                   cfg.max_len, cfg.batch_size, cfg.seed, device)
    print(f"{len(source)} parallel {cfg.unit if cfg.source.endswith('.json') else 'lines'}: {cfg.source} -> "
          f"{cfg.target}; translation vector fitted on {len(source) // 2}, retrieval among the other "
          f"{len(source) - len(source) // 2} (chance: {100 / (len(source) - len(source) // 2):.2f}%)", file=sys.stderr)
    print("layer  accuracy")
    for layer, value in enumerate(accuracies):
        print(f"{layer:>5}  {value:8.2f}")
    print(json.dumps({"checkpoint": cfg.checkpoint, "source": cfg.source, "target": cfg.target,
                      "pairs": len(source), "accuracy_per_layer": accuracies}))


if __name__ == "__main__":
    run_script(main)
