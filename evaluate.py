"""Evaluation for "Rethinking Embedding Coupling in Pre-trained Language Models" (Chung et al., ICLR 2021).

The paper fine-tunes on English and evaluates zero-shot on the XTREME tasks (Section 2, Tables 2-7, 10, 15).
This file holds the official metrics of those tasks, re-implemented so that they give the official
scripts' figures to the last digit (figures in percent, as those scripts print them):

  xnli, pawsx          accuracy
  panx                 entity-level precision / recall / F1 with conlleval semantics
  udpos                token-level accuracy (XTREME lists it as "F1")
  xquad, tydiqa        exact match / F1 of the SQuAD v1.1 script (evaluate-v1.1.py)
  mlqa                 exact match / F1 of the MLQA script (mlqa_evaluation_v1.py): per-language answer
                       normalization

Commands (CPU; every command also runs unchanged on a GPU machine):
  python evaluate.py score --task xquad --gold ../shared/data/xquad/xquad.de.json --predictions pred.json
  python evaluate.py score --task mlqa --lang zh --gold dev-context-zh-question-zh.json --predictions pred.json
  python evaluate.py score --task panx --gold test-de.tsv --predictions pred-de.tsv
  python evaluate.py score --task xnli --gold dev-de.tsv --predictions pred-de.txt
`score` prints one JSON object.
"""

import argparse
import csv
import io
import json
import re
import string
import sys
import unicodedata
from collections import Counter
from pathlib import Path

TASKS = ("xnli", "pawsx", "panx", "udpos", "xquad", "mlqa", "tydiqa")
CLASSIFICATION_LABELS = {
    "xnli": ("contradiction", "entailment", "neutral"),
    "pawsx": ("0", "1"),
}
TAGGING_LABELS = {
    "panx": ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"),
    # The 17 Universal Dependencies v2 part-of-speech tags.
    "udpos": ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON", "PROPN",
              "PUNCT", "SCONJ", "SYM", "VERB", "X"),
}
# The figure each task reports in the paper's tables (XTREME's choice; for QA the paper prints F1 / EM).
MAIN_METRIC = {"xnli": "accuracy", "pawsx": "accuracy", "panx": "f1", "udpos": "accuracy",
               "xquad": "f1", "mlqa": "f1", "tydiqa": "f1"}


class DataError(ValueError):
    """Malformed or mismatched evaluation input; the message names the file, line or field."""


# ---------------------------------------------------------------------------------------------------
# Span extraction: SQuAD v1.1 (XQuAD, TyDiQA-GoldP) and MLQA.
# Mirrors the logic of the official scripts: SQuAD's evaluate-v1.1.py (as vendored in
# google-research/xtreme third_party/evaluate_squad.py) and facebookresearch/MLQA mlqa_evaluation_v1.py.

def squad_normalize(text):
    """SQuAD v1.1: lower case, drop ASCII punctuation, drop the English articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


MLQA_LANGUAGES = ("en", "es", "hi", "vi", "de", "ar", "zh")
MLQA_ARTICLES = {
    "en": r"\b(a|an|the)\b",
    "es": r"\b(un|una|unos|unas|el|la|los|las)\b",
    "vi": r"\b(của|là|cái|chiếc|những)\b",
    "de": r"\b(ein|eine|einen|einem|eines|einer|der|die|das|den|dem|des)\b",
    # Verbatim from the official script. "^" after text can never match, so in effect every "ال"
    # (the article, but also the same two letters anywhere inside a word) becomes a space.
    "ar": "\\sال^|ال",
    "hi": None,  # no articles
    "zh": None,
}


def _is_mlqa_punctuation(ch):
    # The official script builds the set {every char of a Unicode "P*" category} | string.punctuation.
    return unicodedata.category(ch).startswith("P") or ch in string.punctuation


def _mixed_segmentation(text):
    """Chinese: each CJK ideograph (U+4E00-U+9FA5) and each punctuation mark is a token; the rest splits on
    whitespace."""
    tokens, run = [], ""
    for ch in text:
        if "\u4e00" <= ch <= "\u9fa5" or _is_mlqa_punctuation(ch):
            tokens.extend(run.split())
            tokens.append(ch)
            run = ""
        else:
            run += ch
    tokens.extend(run.split())
    return tokens


def mlqa_normalize(text, lang):
    """MLQA v1: lower case, drop Unicode punctuation, drop the language's articles, re-tokenize (Chinese:
    character-level for ideographs) and join the tokens with single spaces."""
    if lang not in MLQA_LANGUAGES:
        raise ValueError(f"MLQA has no normalization for language {lang!r}; choose one of {MLQA_LANGUAGES}")
    text = "".join(ch for ch in text.lower() if not _is_mlqa_punctuation(ch))
    if MLQA_ARTICLES[lang]:
        text = re.sub(MLQA_ARTICLES[lang], " ", text)
    tokens = _mixed_segmentation(text) if lang == "zh" else text.split()
    return " ".join(tokens)


def _token_f1(prediction_tokens, gold_tokens):
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_scores(dataset, predictions, lang=None):
    """Exact match and F1 (percent) of {question id: answer text} predictions against a SQuAD-format dataset
    (the JSON's "data" list). lang=None: SQuAD v1.1 normalization (XQuAD, TyDiQA-GoldP); lang="de" etc.:
    MLQA's. A question without a prediction scores 0 (reported on stderr, as the official scripts do);
    predictions for ids not in the dataset are ignored, as there, and counted in "ignored_predictions"."""
    if lang is not None and lang not in MLQA_LANGUAGES:
        raise DataError(f"MLQA has no normalization for language {lang!r}; choose one of {MLQA_LANGUAGES}")
    for qid, text in predictions.items():
        if not isinstance(text, str):
            raise DataError(f"prediction for question {qid!r} is {type(text).__name__}, not a string")
    normalize = squad_normalize if lang is None else (lambda text: mlqa_normalize(text, lang))
    exact_match = f1 = total = unanswered = 0
    seen = set()
    for qa, where in _questions(dataset):
        total += 1
        seen.add(qa["id"])
        if qa["id"] not in predictions:
            print(f"Unanswered question {qa['id']} will receive score 0.", file=sys.stderr)
            unanswered += 1
            continue
        prediction = normalize(predictions[qa["id"]])
        golds = [normalize(answer["text"]) for answer in qa["answers"]]
        exact_match += max(prediction == gold for gold in golds)
        f1 += max(_token_f1(prediction.split(), gold.split()) for gold in golds)
    if total == 0:
        raise DataError("the gold dataset has no questions")
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total, "total": total,
            "unanswered": unanswered, "ignored_predictions": len(set(predictions) - seen)}


def _questions(dataset):
    """Yields (qa, field path) for every question, checking the SQuAD structure on the way."""
    if not isinstance(dataset, list):
        raise DataError('"data" must be a list of articles')
    for a, article in enumerate(dataset):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise DataError(f'data[{a}] needs a "paragraphs" list')
        for p, paragraph in enumerate(article["paragraphs"]):
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("qas"), list):
                raise DataError(f'data[{a}].paragraphs[{p}] needs a "qas" list')
            for q, qa in enumerate(paragraph["qas"]):
                where = f"data[{a}].paragraphs[{p}].qas[{q}]"
                if not isinstance(qa, dict) or not isinstance(qa.get("id"), str):
                    raise DataError(f'{where} needs a string "id"')
                answers = qa.get("answers")
                if not isinstance(answers, list) or not answers:
                    raise DataError(f'{where} (id {qa["id"]!r}) needs a non-empty "answers" list')
                for i, answer in enumerate(answers):
                    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
                        raise DataError(f'{where}.answers[{i}] needs a string "text"')
                yield qa, where


# ---------------------------------------------------------------------------------------------------
# Tagging and classification.

def entities(tags):
    """Chunks (type, first, last) of one sentence's IOB1/IOB2 tags, found as conlleval (and seqeval's default
    mode) finds them: a chunk ends before B-, O or a change of type; an I- after O or after another type
    starts a new chunk."""
    chunks = []
    prev_tag, prev_type, start = "O", "", 0
    for i, label in enumerate(list(tags) + ["O"]):
        tag, _, type_ = label.partition("-")
        if label != "O" and tag not in ("B", "I"):
            raise ValueError(f"tag {label!r} at position {i} is neither O nor B-TYPE / I-TYPE")
        if prev_tag != "O" and (tag != "I" or type_ != prev_type):
            chunks.append((prev_type, start, i - 1))
        if tag == "B" or (tag == "I" and (prev_tag == "O" or type_ != prev_type)):
            start = i
        prev_tag, prev_type = tag, type_
    return chunks


def _check_parallel(gold, predicted):
    if len(gold) != len(predicted):
        raise DataError(f"{len(gold)} gold sentences but {len(predicted)} predicted")
    for s, (g, p) in enumerate(zip(gold, predicted)):
        if len(g) != len(p):
            raise DataError(f"sentence {s}: {len(g)} gold tags but {len(p)} predicted")


def ner_scores(gold, predicted):
    """Entity-level precision / recall / F1 (percent) over sentences of IOB tags, computed as conlleval does:
    an entity is correct only when its type and both boundaries match."""
    _check_parallel(gold, predicted)
    gold_entities = {(s, *chunk) for s, tags in enumerate(gold) for chunk in entities(tags)}
    predicted_entities = {(s, *chunk) for s, tags in enumerate(predicted) for chunk in entities(tags)}
    correct = len(gold_entities & predicted_entities)
    precision = 100.0 * correct / len(predicted_entities) if predicted_entities else 0.0
    recall = 100.0 * correct / len(gold_entities) if gold_entities else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "gold_entities": len(gold_entities),
            "predicted_entities": len(predicted_entities), "correct_entities": correct}


def pos_scores(gold, predicted):
    """Token-level accuracy (percent) over sentences of tags; XTREME's tables call this figure F1."""
    _check_parallel(gold, predicted)
    flat_gold = [tag for tags in gold for tag in tags]
    flat_predicted = [tag for tags in predicted for tag in tags]
    return {**accuracy(flat_gold, flat_predicted), "tokens": len(flat_gold)}


def accuracy(gold, predicted):
    """Share of predicted labels equal to the gold ones, in percent."""
    if len(gold) != len(predicted):
        raise DataError(f"{len(gold)} gold labels but {len(predicted)} predicted")
    if not gold:
        raise DataError("no examples to score")
    correct = sum(g == p for g, p in zip(gold, predicted))
    return {"accuracy": 100.0 * correct / len(gold), "correct": correct, "total": len(gold)}


# ---------------------------------------------------------------------------------------------------
# Readers for the `score` command. Input is UTF-8 with "\n" line ends; lines are split on "\n" only, since
# real data holds characters (U+001C in PAWS-X ko) that str.splitlines() would also break on.

def _read_text(path):
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte {e.start}: {e.reason})")
    if not text.strip():
        raise DataError(f"{path}: empty file")
    return text


def _lines(path):
    lines = _read_text(path).split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def _check_label(label, labels, path, line):
    if label not in labels:
        raise DataError(f"{path}:{line}: unknown label {label!r}; expected one of {', '.join(labels)}")


def read_classification_gold(path, task):
    """Labels of a `sentence1<TAB>sentence2<TAB>label` file, read with csv rules (quoted fields, doubled
    quotes) as XTREME's csv.writer wrote them."""
    labels = []
    reader = csv.reader(io.StringIO(_read_text(path), newline="\n"), delimiter="\t", strict=True)
    try:
        for row in reader:
            if len(row) != 3:
                raise DataError(f"{path}:{reader.line_num}: expected 3 tab-separated fields "
                                f"(sentence1, sentence2, label), found {len(row)}")
            _check_label(row[2], CLASSIFICATION_LABELS[task], path, reader.line_num)
            labels.append(row[2])
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: {e}")
    return labels


def read_labels(path, task):
    """One label per line."""
    labels = _lines(path)
    for line, label in enumerate(labels, 1):
        _check_label(label, CLASSIFICATION_LABELS[task], path, line)
    return labels


def read_tagged(path, task):
    """Sentences of (token, label) from a `token<TAB>label` file with a blank line between sentences, and
    the line number of each sentence's first token."""
    sentences, starts, sentence = [], [], []
    for line, text in enumerate(_lines(path) + [""], 1):
        if text == "":
            if sentence:
                sentences.append(sentence)
                sentence = []
            continue
        fields = text.split("\t")
        if len(fields) != 2 or not fields[0]:
            raise DataError(f"{path}:{line}: expected `token<TAB>label`, found {text!r}")
        _check_label(fields[1], TAGGING_LABELS[task], path, line)
        if not sentence:
            starts.append(line)
        sentence.append(tuple(fields))
    return sentences, starts


def read_json(path):
    """A JSON file; duplicate keys are an error rather than silently keeping the last one."""
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        duplicated = [k for k, n in Counter(keys).items() if n > 1]
        if duplicated:
            raise DataError(f"{path}: duplicate key {duplicated[0]!r}")
        return dict(pairs)
    try:
        return json.loads(_read_text(path), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})")


def score_files(task, gold_path, predictions_path, lang=None):
    """Scores a prediction file against a gold file in the task's format; returns the metrics dict."""
    if task in CLASSIFICATION_LABELS:
        gold, predicted = read_classification_gold(gold_path, task), read_labels(predictions_path, task)
        if len(gold) != len(predicted):
            raise DataError(f"{gold_path} has {len(gold)} examples but {predictions_path} has {len(predicted)} labels")
        return accuracy(gold, predicted)
    if task in TAGGING_LABELS:
        gold, starts = read_tagged(gold_path, task)
        predicted, _ = read_tagged(predictions_path, task)
        if len(gold) != len(predicted):
            raise DataError(f"{gold_path} has {len(gold)} sentences but {predictions_path} has {len(predicted)}")
        for g, p, line in zip(gold, predicted, starts):
            if [token for token, _ in g] != [token for token, _ in p]:
                raise DataError(f"the sentence at {gold_path}:{line} has other tokens in {predictions_path}")
        tags = [[label for _, label in s] for s in gold], [[label for _, label in s] for s in predicted]
        return ner_scores(*tags) if task == "panx" else pos_scores(*tags)
    gold = read_json(gold_path)
    predictions = read_json(predictions_path)
    if not isinstance(gold, dict) or "data" not in gold:
        raise DataError(f'{gold_path}: not SQuAD-format JSON (no top-level "data")')
    if not isinstance(predictions, dict):
        raise DataError(f"{predictions_path}: expected a JSON object {{question id: answer text}}")
    if task == "mlqa" and lang is None:
        raise DataError("--lang is required for mlqa (its answer normalization depends on the language)")
    try:
        return qa_scores(gold["data"], predictions, lang if task == "mlqa" else None)
    except DataError as e:
        raise DataError(f"{gold_path} / {predictions_path}: {e}")


# ---------------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    score = commands.add_parser("score", help="score a prediction file against a gold file; prints one JSON object")
    score.add_argument("--task", required=True, choices=TASKS)
    score.add_argument("--lang", help="language code; required for mlqa (selects MLQA's answer normalization: "
                                      f"{', '.join(MLQA_LANGUAGES)}), otherwise only echoed in the output")
    score.add_argument("--gold", required=True, help="xnli/pawsx: the task TSV (s1<TAB>s2<TAB>label); panx/udpos: "
                                                     "token<TAB>label; xquad/mlqa/tydiqa: SQuAD-format JSON")
    score.add_argument("--predictions", required=True, help="xnli/pawsx: one label per line; panx/udpos: "
                                                            "token<TAB>label; QA: JSON {question id: answer text}")
    args = parser.parse_args(argv)

    try:
        if args.command == "score":
            result = score_files(args.task, args.gold, args.predictions, args.lang)
            print(json.dumps({"task": args.task, "lang": args.lang, **result}))
    except (DataError, OSError) as e:
        sys.exit(f"evaluate.py: error: {e}")


if __name__ == "__main__":
    main()
