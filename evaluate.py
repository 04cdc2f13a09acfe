r"""Evaluation for "Rethinking Embedding Coupling in Pre-trained Language Models" (Chung et al., ICLR 2021).

The paper fine-tunes on English and evaluates zero-shot on the XTREME tasks (Section 3, Tables 2-7).
This file holds the official metrics of those tasks, re-implemented so that they give the official
scripts' figures to the last digit (figures in percent, as those scripts print them):

  xnli, pawsx          accuracy
  panx                 entity-level precision / recall / F1 with conlleval semantics
  udpos                token-level accuracy (XTREME lists it as "F1")
  xquad, tydiqa        exact match / F1 of the SQuAD v1.1 script (evaluate-v1.1.py)
  mlqa                 exact match / F1 of the MLQA script (mlqa_evaluation_v1.py): per-language answer
                       normalization

It also runs the paper's analyses of a pre-trained model: masked-LM accuracy on held-out text (Table 8) and,
per layer, nearest-neighbour translation accuracy between parallel sentences (Section 6, Figure 2).

Predicting with a model that finetune.py saved, in the formats that `score` reads:
  python evaluate.py predict --model out/finetune/lr-0.0001/seed-0 --task xquad --input ../shared/data/xquad/xquad.de.json \
      --output pred.json
Scoring (prints one JSON object; figures in percent):
  python evaluate.py score --task xquad --gold ../shared/data/xquad/xquad.de.json --predictions pred.json
  python evaluate.py score --task mlqa --lang zh --gold dev-context-zh-question-zh.json --predictions pred.json
  python evaluate.py score --task panx --gold test-de.tsv --predictions pred-de.tsv
  python evaluate.py score --task xnli --gold dev-de.tsv --predictions pred-de.txt
Analyses (single process; --device auto picks a GPU when torch sees one, PJRT_DEVICE=TPU selects a TPU):
  python evaluate.py mlm-accuracy --checkpoint out/pretrain/ckpt-00000800.pt --tokenizer out/tokenizer/spm.model \
      --data held_out.txt
  python evaluate.py translation-probe --checkpoint out/pretrain/ckpt-00000800.pt --tokenizer out/tokenizer/spm.model \
      --source ../shared/data/xquad/xquad.en.json --target ../shared/data/xquad/xquad.zh.json
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
# The label sets, in the order of the task heads' outputs (finetune.py).
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
    for qa in _questions(dataset):
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
    """Every question of a SQuAD-format "data" list, checking the structure on the way."""
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
                yield qa


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
# The paper's analyses. torch, model.py and data.py are imported where needed, so that the metrics above
# stay importable with the standard library alone.

def load_masked_lm(path):
    """A MaskedLM from a pretrain.py checkpoint (torch.save dict with "model" and "config") or from a
    Hugging Face RemBERT directory."""
    import torch
    from model import MaskedLM, ModelConfig
    if Path(path).is_dir():
        return MaskedLM.from_hf(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or not {"model", "config"} <= checkpoint.keys():
        raise DataError(f'{path}: not a pretrain.py checkpoint (needs the keys "model" and "config")')
    try:
        model = MaskedLM(ModelConfig(**checkpoint["config"]))
        model.load_state_dict(checkpoint["model"])
    except (TypeError, RuntimeError) as e:
        raise DataError(f"{path}: the weights do not fit the saved config: {e}")
    return model


def mlm_accuracy(model, batches, device="cpu"):
    """Masked-LM accuracy (percent) and mean cross-entropy over the masked positions of `batches`, dicts as
    data.MLMLoader yields them (masked_weights 0 marks padding predictions). Table 8 of the paper."""
    import torch
    import torch.nn.functional as F
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, summed loss, predictions
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits, _ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                              batch["masked_positions"])  # (B, P, V)
            ids, weights = batch["masked_ids"].flatten(), batch["masked_weights"].flatten().double()
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids, reduction="none")
            correct = (logits.argmax(-1).flatten() == ids).double()
            totals += torch.stack([(correct * weights).sum(), (loss * weights).sum(), weights.sum()])
    correct, loss, count = totals.tolist()  # the one host sync, after the loop
    if count == 0:
        raise DataError("no masked positions to score")
    return {"accuracy": 100.0 * correct / count, "loss": loss / count, "predictions": round(count)}


def sentence_embeddings(encoder, sentences, cls_id, sep_id, pad_id, max_len=128, batch_size=32, device="cpu"):
    """One vector per sentence and layer: the mean of the sentence's token states without [CLS], [SEP] and
    padding. `sentences` are token-id lists (truncated to max_len - 2). Returns num_layers + 1 tensors
    (N, H): the embedding output (after the E_in -> H projection), then each layer's output."""
    import torch
    encoder.eval()
    rows = [[cls_id] + ids[:max_len - 2] + [sep_id] for ids in sentences]
    for i, row in enumerate(rows):
        if len(row) == 2:
            raise DataError(f"sentence {i} has no tokens")
    per_layer = None
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            real = len(chunk)
            chunk = chunk + [chunk[0]] * (batch_size - real)  # a full batch: one shape for every step
            input_ids = torch.full((batch_size, max_len), pad_id, dtype=torch.long)
            attention_mask = torch.zeros(batch_size, max_len, dtype=torch.long)
            for b, row in enumerate(chunk):
                input_ids[b, :len(row)] = torch.tensor(row)
                attention_mask[b, :len(row)] = 1
            tokens = attention_mask.clone()
            tokens[:, 0] = 0  # [CLS]
            tokens[torch.arange(batch_size), attention_mask.sum(1) - 1] = 0  # [SEP]
            _, states = encoder(input_ids.to(device), attention_mask=attention_mask.to(device),
                                output_hidden_states=True)
            weights = tokens.to(device)[:, :, None].float()  # (B, T, 1)
            means = [((h.float() * weights).sum(1) / weights.sum(1))[:real].cpu() for h in states]  # (B, H)
            per_layer = means if per_layer is None else [torch.cat(pair) for pair in zip(per_layer, means)]
    return per_layer


def translation_accuracy(source, target, fit, test):
    """Nearest-neighbour translation accuracy (percent) of one layer (Figure 2's method): the translation
    vector is the mean of target - source over the `fit` pairs; each `test` source plus that vector
    retrieves its nearest `test` target by L2 distance, and is right when that is its own translation."""
    import torch
    translation = (target[fit] - source[fit]).double().mean(0)
    distances = torch.cdist(source[test].double() + translation, target[test].double())  # (n_test, n_test)
    hits = distances.argmin(1) == torch.arange(len(test))
    return 100.0 * hits.double().mean().item()


def translation_probe(encoder, source, target, cls_id, sep_id, pad_id, max_len=128, batch_size=32, seed=0,
                      device="cpu"):
    """Per-layer translation accuracy (percent, a list of num_layers + 1) between parallel token-id lists.
    The pairs are split at random (seeded) into two halves: the translation vector is fitted on one and the
    accuracy measured on the other, so the vector never saw the pairs it retrieves."""
    import torch
    if len(source) != len(target):
        raise DataError(f"{len(source)} source sentences but {len(target)} target sentences")
    if len(source) < 4:
        raise DataError(f"the probe needs at least 4 sentence pairs, got {len(source)}")
    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(seed))
    fit, test = order[:len(order) // 2], order[len(order) // 2:]
    embed = lambda sentences: sentence_embeddings(encoder, sentences, cls_id, sep_id, pad_id, max_len,
                                                  batch_size, device)
    return [translation_accuracy(s, t, fit, test) for s, t in zip(embed(source), embed(target))]


def read_parallel(source_path, target_path, unit="questions"):
    """Parallel sentences: two SQuAD-format JSON files (XQuAD: the same question ids and paragraph order in
    every language), paired by question id or paragraph position; or two line-parallel text files."""
    if Path(source_path).suffix != ".json":
        source, target = _lines(source_path), _lines(target_path)
        if len(source) != len(target):
            raise DataError(f"{source_path} has {len(source)} lines but {target_path} has {len(target)}")
        for path, lines in ((source_path, source), (target_path, target)):
            for line, text in enumerate(lines, 1):
                if not text.strip():
                    raise DataError(f"{path}:{line}: empty line")
        return source, target
    sides = []
    for path in (source_path, target_path):
        data = read_json(path)
        if not isinstance(data, dict) or "data" not in data:
            raise DataError(f'{path}: not SQuAD-format JSON (no top-level "data")')
        paragraphs = [p for article in data["data"] for p in article["paragraphs"]]
        if unit == "contexts":
            sides.append({tuple(qa["id"] for qa in p["qas"]): p["context"] for p in paragraphs})
        else:
            sides.append({qa["id"]: qa["question"] for p in paragraphs for qa in p["qas"]})
    if sides[0].keys() != sides[1].keys():
        raise DataError(f"{source_path} and {target_path} are not parallel: their question ids differ")
    return list(sides[0].values()), [sides[1][key] for key in sides[0]]


# ---------------------------------------------------------------------------------------------------

def load_encoder(path):
    """The Encoder of a pretrain.py checkpoint (the MLM head and pre-training-only layers dropped) or of a
    Hugging Face RemBERT directory."""
    from model import Encoder
    return Encoder.from_hf(path) if Path(path).is_dir() else load_masked_lm(path).encoder


def run_mlm_accuracy(args):
    from data import MLMLoader, Tokenizer
    from pretrain import setup_runtime
    device = setup_runtime(args.device).device
    model = load_masked_lm(args.checkpoint).to(device)
    loader = MLMLoader(args.data, Tokenizer(args.tokenizer), batch_size=args.batch_size, seq_len=args.seq_len,
                       max_predictions=args.max_predictions, rank=0, world_size=1, seed=args.seed)
    result = mlm_accuracy(model, loader, device)
    print(json.dumps({"checkpoint": args.checkpoint, "data": args.data, **result}))


def run_translation_probe(args):
    from data import Tokenizer
    from pretrain import setup_runtime
    device = setup_runtime(args.device).device
    tokenizer = Tokenizer(args.tokenizer)
    source, target = read_parallel(args.source, args.target, args.unit)
    encoder = load_encoder(args.checkpoint).to(device)
    print(f"{len(source)} parallel {args.unit if args.source.endswith('.json') else 'lines'}: {args.source} -> "
          f"{args.target}; translation vector fitted on {len(source) // 2}, "
          f"retrieval among the other {len(source) - len(source) // 2}", file=sys.stderr)
    accuracies = translation_probe(encoder, [tokenizer.encode(t) for t in source],
                                   [tokenizer.encode(t) for t in target], tokenizer.cls_id, tokenizer.sep_id,
                                   tokenizer.pad_id, args.max_len, args.batch_size, args.seed, device)
    print("layer  accuracy")
    for layer, value in enumerate(accuracies):
        print(f"{layer:>5}  {value:8.2f}")
    print(json.dumps({"checkpoint": args.checkpoint, "source": args.source, "target": args.target,
                      "pairs": len(source), "accuracy_per_layer": accuracies}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    score = commands.add_parser("score", allow_abbrev=False,
                                help="score a prediction file against a gold file; prints one JSON object")
    score.add_argument("--task", required=True, choices=TASKS)
    score.add_argument("--lang", help="language code; required for mlqa (selects MLQA's answer normalization: "
                                      f"{', '.join(MLQA_LANGUAGES)}), otherwise only echoed in the output")
    score.add_argument("--gold", required=True, help="xnli/pawsx: the task TSV (s1<TAB>s2<TAB>label); panx/udpos: "
                                                     "token<TAB>label; xquad/mlqa/tydiqa: SQuAD-format JSON")
    score.add_argument("--predictions", required=True, help="xnli/pawsx: one label per line; panx/udpos: "
                                                            "token<TAB>label; QA: JSON {question id: answer text}")

    mlm = commands.add_parser("mlm-accuracy", allow_abbrev=False,
                              help="masked-LM accuracy on held-out text (Table 8); prints one JSON object")
    mlm.add_argument("--checkpoint", required=True, help="a pretrain.py checkpoint or a Hugging Face RemBERT dir")
    mlm.add_argument("--data", required=True, help="held-out text: a file or a directory of *.txt, one sentence "
                                                   "or document per line (as pretrain.py --data)")
    mlm.add_argument("--tokenizer", required=True, help="the SentencePiece model the checkpoint was trained with")
    mlm.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    mlm.add_argument("--max-predictions", type=int, default=20, help="masked positions per sequence (default: 20)")
    mlm.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default: 32)")
    mlm.add_argument("--seed", type=int, default=0, help="seed of the masking (default: 0)")
    mlm.add_argument("--device", default="auto", help="auto | cpu | cuda | xla (default: auto)")

    xquad = Path(__file__).resolve().parent.parent / "shared" / "data" / "xquad"
    probe = commands.add_parser("translation-probe", allow_abbrev=False,
                                help="per-layer nearest-neighbour translation accuracy (Figure 2's method)")
    probe.add_argument("--checkpoint", required=True, help="a pretrain.py checkpoint or a Hugging Face RemBERT dir")
    probe.add_argument("--tokenizer", required=True, help="the SentencePiece model the checkpoint was trained with")
    probe.add_argument("--source", default=str(xquad / "xquad.en.json"),
                       help="source sentences: SQuAD-format JSON, or a text file line-parallel to --target "
                            "(default: XQuAD en in ../shared/data)")
    probe.add_argument("--target", default=str(xquad / "xquad.de.json"),
                       help="target sentences, parallel to --source (default: XQuAD de in ../shared/data)")
    probe.add_argument("--unit", choices=("questions", "contexts"), default="questions",
                       help="for JSON: pair the questions (by id) or the contexts (default: questions)")
    probe.add_argument("--max-len", type=int, default=128, help="tokens per sentence, with [CLS] and [SEP] "
                                                                "(default: 128)")
    probe.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default: 32)")
    probe.add_argument("--seed", type=int, default=0, help="seed of the fit/test split of the pairs (default: 0)")
    probe.add_argument("--device", default="auto", help="auto | cpu | cuda | xla (default: auto)")
    predict = commands.add_parser("predict", allow_abbrev=False,
                                  help="predict with a model saved by finetune.py, in the format `score` reads")
    predict.add_argument("--model", required=True, help="a directory finetune.py saved (e.g. out/finetune/seed-0)")
    predict.add_argument("--task", required=True, choices=TASKS)
    predict.add_argument("--input", required=True, help="a file in the task's format (as --gold of `score`)")
    predict.add_argument("--output", required=True, help="xnli/pawsx: one label per line; panx/udpos: "
                                                         "token<TAB>label; QA: JSON {question id: answer text}")
    predict.add_argument("--batch-size", type=int, default=64, help="sequences per batch (default: 64)")
    predict.add_argument("--device", default="auto", help="auto | cpu | cuda | xla (default: auto)")
    args = parser.parse_args(argv)

    try:
        if args.command == "predict":
            import finetune  # torch and the model: only this command needs them
            finetune.predict_file(args.model, args.task, args.input, args.output, args.device, args.batch_size)
        elif args.command == "score":
            result = score_files(args.task, args.gold, args.predictions, args.lang)
            print(json.dumps({"task": args.task, "lang": args.lang, **result}))
        elif args.command == "mlm-accuracy":
            run_mlm_accuracy(args)
        else:
            run_translation_probe(args)
    except (DataError, OSError) as e:
        sys.exit(f"evaluate.py: error: {e}")


if __name__ == "__main__":
    main()
