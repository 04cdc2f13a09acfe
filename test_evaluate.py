"""Tests for evaluate.py: the official metrics against hand-worked figures and against verbatim copies of the
official scripts (oracles below), the `score` command, and the paper's analyses on a tiny model."""

import csv
import json
import random
import re
import string
import sys
import unicodedata
import warnings
from collections import Counter
from pathlib import Path

import pytest

import evaluate
from evaluate import entities, mlqa_normalize, ner_scores, pos_scores, qa_scores, squad_normalize
from checkpoints import DataError, from_checkpoint
from configs import run_script

REPO = Path(__file__).parent
DATA = REPO.parent / "shared" / "data"


# ---------------------------------------------------------------------------------------------------
# Oracles: verbatim copies of the official code (only renamed, and the MLQA Arabic regex written as the
# same string without the invalid-escape warning).

# SQuAD v1.1 evaluate-v1.1.py (google-research/xtreme third_party/evaluate_squad.py).
def official_squad_normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


# facebookresearch/MLQA mlqa_evaluation_v1.py
PUNCT = {chr(i) for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith('P')}.union(string.punctuation)
WHITESPACE_LANGS = ['en', 'es', 'hi', 'vi', 'de', 'ar']
MIXED_SEGMENTATION_LANGS = ['zh']


def whitespace_tokenize(text):
    return text.split()


def mixed_segmentation(text):
    segs_out = []
    temp_str = ""
    for char in text:
        if re.search(r'[\u4e00-\u9fa5]', char) or char in PUNCT:
            if temp_str != "":
                ss = whitespace_tokenize(temp_str)
                segs_out.extend(ss)
                temp_str = ""
            segs_out.append(char)
        else:
            temp_str += char

    if temp_str != "":
        ss = whitespace_tokenize(temp_str)
        segs_out.extend(ss)

    return segs_out


def official_mlqa_normalize_answer(s, lang):
    """Lower text and remove punctuation, articles and extra whitespace."""

    def remove_articles(text, lang):
        if lang == 'en':
            return re.sub(r'\b(a|an|the)\b', ' ', text)
        elif lang == 'es':
            return re.sub(r'\b(un|una|unos|unas|el|la|los|las)\b', ' ', text)
        elif lang == 'hi':
            return text # Hindi does not have formal articles
        elif lang == 'vi':
            return re.sub(r'\b(của|là|cái|chiếc|những)\b', ' ', text)
        elif lang == 'de':
            return re.sub(r'\b(ein|eine|einen|einem|eines|einer|der|die|das|den|dem|des)\b', ' ', text)
        elif lang == 'ar':
            return re.sub(r'\sال^|ال', ' ', text)
        elif lang == 'zh':
            return text # Chinese does not have formal articles
        else:
            raise Exception('Unknown Language {}'.format(lang))

    def white_space_fix(text, lang):
        if lang in WHITESPACE_LANGS:
            tokens = whitespace_tokenize(text)
        elif lang in MIXED_SEGMENTATION_LANGS:
            tokens = mixed_segmentation(text)
        else:
            raise Exception('Unknown Language {}'.format(lang))
        return ' '.join([t for t in tokens if t.strip() != ''])

    def remove_punc(text):
        return ''.join(ch for ch in text if ch not in PUNCT)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s)), lang), lang)


# The scoring part, identical in both scripts up to the `lang` argument.
def official_evaluate(dataset, predictions, normalize_answer):
    def f1_score(prediction, ground_truth):
        prediction_tokens = normalize_answer(prediction).split()
        ground_truth_tokens = normalize_answer(ground_truth).split()
        common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
        num_same = sum(common.values())
        if num_same == 0:
            return 0
        precision = 1.0 * num_same / len(prediction_tokens)
        recall = 1.0 * num_same / len(ground_truth_tokens)
        f1 = (2 * precision * recall) / (precision + recall)
        return f1

    def exact_match_score(prediction, ground_truth):
        return normalize_answer(prediction) == normalize_answer(ground_truth)

    def metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
        scores_for_ground_truths = []
        for ground_truth in ground_truths:
            score = metric_fn(prediction, ground_truth)
            scores_for_ground_truths.append(score)
        return max(scores_for_ground_truths)

    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue
                ground_truths = list(map(lambda x: x["text"], qa["answers"]))
                prediction = predictions[qa["id"]]
                exact_match += metric_max_over_ground_truths(
                    exact_match_score, prediction, ground_truths
                )
                f1 += metric_max_over_ground_truths(f1_score, prediction, ground_truths)

    exact_match = 100.0 * exact_match / total
    f1 = 100.0 * f1 / total

    return {"exact_match": exact_match, "f1": f1}


# seqeval (chakki-works/seqeval) metrics/sequence_labeling.py, default (non-strict) mode = conlleval.
def seqeval_get_entities(seq, suffix=False):
    if any(isinstance(s, list) for s in seq):
        seq = [item for sublist in seq for item in sublist + ['O']]

    prev_tag = 'O'
    prev_type = ''
    begin_offset = 0
    chunks = []
    for i, chunk in enumerate(seq + ['O']):
        tag = chunk[0]
        type_ = chunk[1:].split('-', maxsplit=1)[-1] or '_'

        if seqeval_end_of_chunk(prev_tag, tag, prev_type, type_):
            chunks.append((prev_type, begin_offset, i-1))
        if seqeval_start_of_chunk(prev_tag, tag, prev_type, type_):
            begin_offset = i
        prev_tag = tag
        prev_type = type_

    return chunks


def seqeval_end_of_chunk(prev_tag, tag, prev_type, type_):
    chunk_end = False

    if prev_tag == 'E': chunk_end = True
    if prev_tag == 'S': chunk_end = True

    if prev_tag == 'B' and tag == 'B': chunk_end = True
    if prev_tag == 'B' and tag == 'S': chunk_end = True
    if prev_tag == 'B' and tag == 'O': chunk_end = True
    if prev_tag == 'I' and tag == 'B': chunk_end = True
    if prev_tag == 'I' and tag == 'S': chunk_end = True
    if prev_tag == 'I' and tag == 'O': chunk_end = True

    if prev_tag != 'O' and prev_tag != '.' and prev_type != type_:
        chunk_end = True

    return chunk_end


def seqeval_start_of_chunk(prev_tag, tag, prev_type, type_):
    chunk_start = False

    if tag == 'B': chunk_start = True
    if tag == 'S': chunk_start = True

    if prev_tag == 'E' and tag == 'E': chunk_start = True
    if prev_tag == 'E' and tag == 'I': chunk_start = True
    if prev_tag == 'S' and tag == 'E': chunk_start = True
    if prev_tag == 'S' and tag == 'I': chunk_start = True
    if prev_tag == 'O' and tag == 'E': chunk_start = True
    if prev_tag == 'O' and tag == 'I': chunk_start = True

    if tag != 'O' and tag != '.' and prev_type != type_:
        chunk_start = True

    return chunk_start


def xtreme_tagging_f1(y_true, y_pred):
    """google-research/xtreme evaluate.py's f1(): seqeval's precision_score, recall_score and f1_score, times 100."""
    true_entities, pred_entities = set(seqeval_get_entities(y_true)), set(seqeval_get_entities(y_pred))
    nb_correct, nb_pred, nb_true = len(true_entities & pred_entities), len(pred_entities), len(true_entities)
    p = nb_correct / nb_pred if nb_pred > 0 else 0
    r = nb_correct / nb_true if nb_true > 0 else 0
    score = 2 * p * r / (p + r) if p + r > 0 else 0
    return {'f1': score * 100, 'precision': p * 100, 'recall': r * 100}


# ---------------------------------------------------------------------------------------------------
# Span extraction

def squad(*questions):
    """A one-article SQuAD dataset from (id, [gold answers]) pairs."""
    return [{"paragraphs": [{"context": "", "qas": [{"id": qid, "question": "?",
                                                     "answers": [{"text": t, "answer_start": 0} for t in answers]}
                                                    for qid, answers in questions]}]}]


def test_squad_hand_worked():
    data = squad(("q1", ["The Eiffel Tower"]), ("q2", ["Paris, France", "Paris"]), ("q3", ["1889"]),
                 ("q4", ["a big red dog"]))
    predictions = {"q1": "eiffel tower.",   # EM after normalization: article, case, punctuation
                   "q2": "in Paris",        # F1 max over golds: vs "paris" P=1/2 R=1 -> 2/3
                   "q4": "red dog!"}        # P=1 R=2/3 -> 0.8; q3 missing -> 0
    result = qa_scores(data, predictions)
    assert result["exact_match"] == 100.0 * 1 / 4
    assert result["f1"] == 100.0 * (1 + 2 / 3 + 0.8) / 4
    assert result["unanswered"] == 1 and result["total"] == 4 and result["ignored_predictions"] == 0


def test_squad_edge_cases(capsys):
    data = squad(("e", ["..."]), ("f", ["!?"]), ("g", [""]), ("h", ["x"]))
    # Punctuation-only answers normalize to "": EM 1 when the prediction also does, F1 0 (no tokens).
    result = qa_scores(data, {"e": "", "f": "?!", "g": "", "h": "", "extra": "y"})
    assert result["exact_match"] == 75.0 and result["f1"] == 0.0 and result["ignored_predictions"] == 1
    assert qa_scores(data, {})["exact_match"] == 0.0
    assert "Unanswered question e will receive score 0." in capsys.readouterr().err
    with pytest.raises(DataError, match="no questions"):  # a library call with an empty set: no ZeroDivisionError
        qa_scores([], {})


def test_squad_keeps_non_ascii_punctuation():
    # SQuAD v1.1 only strips string.punctuation: "«" and "。" stay part of the tokens.
    assert squad_normalize("«Die Welt» — the end.") == "«die welt» — end"
    assert qa_scores(squad(("q", ["巴黎"])), {"q": "巴黎。"})["exact_match"] == 0.0


def test_mlqa_hand_worked():
    assert mlqa_normalize("Der Hund und die Katze, ein Haus", "de") == "hund und katze haus"
    assert mlqa_normalize("Los perros y una casa", "es") == "perros y casa"
    assert mlqa_normalize("Những con mèo của tôi là cái bàn", "vi") == "con mèo tôi bàn"
    # Arabic: every "ال" becomes a space, also in the middle of a word.
    assert mlqa_normalize("الكتاب «جميل»", "ar") == "كتاب جميل"
    assert mlqa_normalize("محالّ", "ar") == "مح ّ"
    assert mlqa_normalize("北京大学，2008年！", "zh") == "北 京 大 学 2008 年"
    assert mlqa_normalize("The end", "hi") == "the end"     # no articles removed outside their language
    # Chinese F1 is over characters: "北京大学" vs "北京" -> P=1 R=1/2
    result = qa_scores(squad(("q", ["北京"])), {"q": "北京大学"}, lang="zh")
    assert result["f1"] == 100.0 * ((2 * 1.0 * 0.5) / (1.0 + 0.5)) / 1 and result["exact_match"] == 0.0
    with pytest.raises(ValueError, match="xx"):
        qa_scores(squad(("q", ["a"])), {}, lang="xx")


ALPHABET = (list("abcdeuvxyz ABCZ  ") + ["the ", " a ", " an ", "The", "der ", " die", "Das ", "eines ", "el ",
            " las ", "una ", "của ", " những ", " là ", "cái", "chiếc ", "ال", " الكتاب ", "ب", "北", "京", "大", "年", "龥", "鿦",
            "𠀀", "ア", "1", "9", ".", ",", "!", "'", "-", "，", "。", "「", "」", "«", "»", "¿", "—", "…", "\u3000",
            "\xa0", "\t", "\n", "İ", "ß", "É", "ñ", "ủ", "ệ", "\u0301", "\u200b", "\x1c"])


def random_text(rng):
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 10)))


@pytest.mark.parametrize("lang", [None, *evaluate.MLQA_LANGUAGES])
def test_qa_matches_official_scripts_on_random_input(lang):
    rng = random.Random(hash(lang) % 1000)
    normalize = official_squad_normalize_answer if lang is None else (
        lambda s: official_mlqa_normalize_answer(s, lang))
    for _ in range(20):
        questions = [(f"q{i}", [random_text(rng) for _ in range(rng.randint(1, 3))]) for i in range(20)]
        data = squad(*questions)
        predictions = {}
        for qid, answers in questions:
            if rng.random() < 0.8:  # some unanswered; predictions often near a gold answer
                predictions[qid] = rng.choice(answers) + random_text(rng) if rng.random() < 0.5 else random_text(rng)
        for text in (t for _, answers in questions for t in answers):
            assert (squad_normalize(text) if lang is None else mlqa_normalize(text, lang)) == normalize(text)
        ours = qa_scores(data, predictions, lang)
        official = official_evaluate(data, predictions, normalize)
        assert (ours["exact_match"], ours["f1"]) == (official["exact_match"], official["f1"])


def test_qa_matches_official_on_real_xquad():
    path = DATA / "xquad" / "xquad.zh.json"
    if not path.exists():
        pytest.skip("../shared/data is absent")
    data = json.loads(path.read_text())["data"]
    rng = random.Random(0)
    # Predictions: a gold answer with random characters cut off or added, for every other question.
    predictions = {qa["id"]: qa["answers"][0]["text"][rng.randint(0, 2):] + rng.choice(["", "的", "。", " x"])
                   for article in data for p in article["paragraphs"] for qa in p["qas"][::2]}
    for lang in (None, "zh"):
        normalize = official_squad_normalize_answer if lang is None else (
            lambda s: official_mlqa_normalize_answer(s, "zh"))
        ours = qa_scores(data, predictions, lang)
        official = official_evaluate(data, predictions, normalize)
        assert (ours["exact_match"], ours["f1"]) == (official["exact_match"], official["f1"])


# ---------------------------------------------------------------------------------------------------
# Tagging and classification

def test_entities_iob_edge_cases():
    assert entities(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3)]
    assert entities(["O", "I-PER", "I-PER"]) == [("PER", 1, 2)]                  # I- after O starts (IOB1)
    assert entities(["B-PER", "I-LOC", "I-LOC"]) == [("PER", 0, 0), ("LOC", 1, 2)]  # type change mid-entity
    assert entities(["B-PER", "B-PER"]) == [("PER", 0, 0), ("PER", 1, 1)]
    assert entities(["I-ORG", "B-ORG", "I-ORG"]) == [("ORG", 0, 0), ("ORG", 1, 2)]
    assert entities(["O", "O", "B-ORG"]) == [("ORG", 2, 2)]                         # entity at sentence end
    assert entities([]) == []
    assert entities(["B-PER", "E-PER", "S-LOC"]) == [("PER", 0, 1), ("LOC", 2, 2)]  # seqeval reads IOBES too


def test_ner_scores_hand_worked():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "I-ORG"]]
    predicted = [["B-PER", "I-PER", "O", "B-ORG"],   # PER right; LOC typed wrong
                 ["B-ORG", "I-ORG", "O"]]            # ORG boundary wrong
    result = ner_scores(gold, predicted)
    assert (result["correct_entities"], result["predicted_entities"], result["gold_entities"]) == (1, 3, 3)
    assert result["f1"] == pytest.approx(100 / 3)
    # A chunk does not run across a sentence boundary.
    assert ner_scores([["B-PER"], ["I-PER"]], [["B-PER"], ["I-PER"]])["gold_entities"] == 2
    assert ner_scores([["O"]], [["O"]])["f1"] == 0.0
    with pytest.raises(ValueError, match="sentence 0"):
        ner_scores([["O", "O"]], [["O"]])


@pytest.mark.parametrize("task", ["panx", "udpos"])
def test_tagging_scores_match_xtreme_on_random_tags(task):
    rng = random.Random(0)
    labels = evaluate.TAGGING_LABELS[task] + (("O", "O") if task == "panx" else ())
    for _ in range(300):
        lengths = [rng.randint(0, 8) for _ in range(rng.randint(1, 4))]
        gold = [[rng.choice(labels) for _ in range(n)] for n in lengths]
        predicted = [[rng.choice(labels) if rng.random() < 0.3 else tag for tag in tags] for tags in gold]
        result = ner_scores(gold, predicted)
        assert {m: result[m] for m in ("f1", "precision", "recall")} == xtreme_tagging_f1(gold, predicted)
        assert result["gold_entities"] == len(set(seqeval_get_entities(gold)))


def test_pos_and_accuracy():
    # XTREME's udpos figure is seqeval's F1, which reads "NOUN" as prefix N of type "OUN": a run of one tag is
    # one chunk, so here no chunk is right though two tokens of three are.
    result = pos_scores([["NOUN", "NOUN", "VERB"]], [["NOUN", "VERB", "VERB"]])
    assert result["f1"] == 0.0 and result["accuracy"] == 2 / 3 * 100
    # As XTREME computes accuracy: float(correct) / len(predictions) * 100 (100 * 2 / 3 differs in the last digit).
    assert evaluate.accuracy(["0", "1", "1"], ["0", "0", "1"])["accuracy"] == float(2) / 3 * 100
    with pytest.raises(ValueError, match="2 gold labels but 1"):
        evaluate.accuracy(["0", "1"], ["0"])


# ---------------------------------------------------------------------------------------------------
# The `score` command

def run_score(capsys, task, gold, predictions, *extra):
    evaluate.main(["score", "--task", task, "--gold", str(gold), "--predictions", str(predictions), *extra])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def write(path, text):
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def score_error(capsys, task, gold, predictions, *extra):
    with pytest.raises(DataError) as error:
        evaluate.main(["score", "--task", task, "--gold", str(gold), "--predictions", str(predictions), *extra])
    return str(error.value)


def test_score_classification(tmp_path, capsys):
    # Quoted fields with doubled quotes (XTREME's csv.writer), and U+001C inside a sentence.
    gold = write(tmp_path / "gold.tsv", 'a\tb\t1\n"say ""hi""\tc\x1cd"\te\t0\nf\tg\t1\n')
    result = run_score(capsys, "pawsx", gold, write(tmp_path / "p.txt", "1\n0\n0\n"))
    assert result["accuracy"] == 2 / 3 * 100 and result["total"] == 3 and result["task"] == "pawsx"
    windows = write(tmp_path / "crlf.tsv", b"\xef\xbb\xbf" + gold.read_bytes().replace(b"\n", b"\r\n"))
    assert run_score(capsys, "pawsx", windows, write(tmp_path / "p.txt", "1\r\n0\r\n0\r\n")) == result
    assert "p.txt:2: unknown label 'x'" in score_error(capsys, "pawsx", gold, write(tmp_path / "p.txt", "1\nx\n0\n"))
    assert "3 examples but" in score_error(capsys, "pawsx", gold, write(tmp_path / "p.txt", "1\n0\n"))
    bad = write(tmp_path / "bad.tsv", "a\tb\t1\na\tb\n")
    assert "bad.tsv:2: 2 tab-separated fields" in score_error(capsys, "pawsx", bad, tmp_path / "p.txt")
    assert "bad.tsv:1: 2 tab-separated fields; expected 3: sentence1<TAB>sentence2<TAB>label" in score_error(
        capsys, "pawsx", write(bad, "a\tb\nc\td\n"), tmp_path / "p.txt")  # no labels to score against
    assert "bad.tsv:1: unknown label 'neutral'" in score_error(
        capsys, "pawsx", write(bad, "a\tb\tneutral\n"), tmp_path / "p.txt")
    assert "empty file" in score_error(capsys, "xnli", write(bad, ""), tmp_path / "p.txt")
    assert "bad.tsv:2: not UTF-8" in score_error(capsys, "xnli", write(bad, b"a\tb\tneutral\n\xff\n"), gold)


def test_score_reports_each_language_of_xnli_1_0s_own_files(capsys, tmp_path):
    gold = DATA / "xnli" / "original_format_samples" / "XNLI-1.0" / "xnli.dev.tsv"
    if not gold.exists():
        pytest.skip("../shared/data is absent")
    rows = [line.split("\t") for line in gold.read_text().split("\n")[1:] if line]
    predicted = [row[1] if row[0] != "de" else "entailment" if row[1] != "entailment" else "neutral" for row in rows]
    result = run_score(capsys, "xnli", gold, write(tmp_path / "p.txt", "\n".join(predicted) + "\n"))
    assert len(result["languages"]) == 15 and result["languages"]["de"] == 0.0
    assert all(value == 100.0 for lang, value in result["languages"].items() if lang != "de")


def as_script(capsys, monkeypatch, argv):
    """`python evaluate.py argv` as its `if __name__ == "__main__"` runs it (run_script around main), in this
    process: the exit code (0 where main returns), stdout and stderr."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # (run_script sets it for the process)
    capsys.readouterr()
    code = 0
    try:
        run_script(lambda: evaluate.main(argv))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_user_mistake_is_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    gold = write(tmp_path / "gold.tsv", "a\tb\t1\n")
    for command, message in (
            (["score", "--task", "pawsx", "--gold", str(gold), "--predictions", str(tmp_path / "missing.txt")],
             "missing.txt"),
            (["mlm-accuracy", "--checkpoint", "c.pt", "--data", "d", "--tokenizer", "t", "--device", "xla"],
             "--device xla needs torch-xla"),
            (["translation-probe", "--checkpoint", "c.pt", "--tokenizer", "t", "--source", str(gold), "--target",
              str(gold), "--max-len", "2"], "--max-len"),
            # No data/ (the default place of XTREME's files): named by its flag as every missing file, not a traceback.
            (["translation-probe", "--checkpoint", "c.pt", "--source", str(tmp_path / "none.json")],
             f"--source {tmp_path / 'none.json'} (XQuAD: docs/data.md says where to get it): no such file"),
            (["--task", "xquad", "--gold", str(gold), "--predictions", str(gold)],  # no command: not "invalid choice"
             "the first word must be the command, one of score, mlm-accuracy, translation-probe"),
            # A name with a line break: escaped as Python would, the line stays one.
            (["score", "--task", "pawsx", "--gold", str(tmp_path / "x\ny.tsv"), "--predictions", str(gold)],
             "x\\ny.tsv: no such file"),
            (["mlm-accuracy", "--checkpoint", "c", "--data", "d", "--batches", str(2 ** 63)],
             "--batches must be below 2^63")):
        code, _, err = as_script(capsys, monkeypatch, command)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    def no_memory(*args):
        raise MemoryError  # (Python's: it says nothing)
    monkeypatch.setattr(evaluate, "score_files", no_memory)
    code, _, err = as_script(capsys, monkeypatch, ["score", "--task", "pawsx", "--gold", str(gold), "--predictions",
                                                   str(gold)])
    assert code == 2 and ": error: out of memory (MemoryError); " in err and err.count("\n") == 1, err
    assert "a smaller model, batch size or sequence length needs less" in err  # (finetune.py has two batch sizes)


def test_score_names_a_missing_or_irregular_file_by_its_flag(tmp_path):
    """A FIFO would block the reader, /dev/zero never end: refused before reading, as a missing file is, by flag."""
    import os
    gold, fifo = write(tmp_path / "gold.tsv", "a\tb\t1\n"), tmp_path / "p.txt"
    os.mkfifo(fifo)
    for gold_path, predictions, said in ((gold, fifo, f"--predictions {fifo}: not a regular file"),
                                         (tmp_path / "none.tsv", gold, f"--gold {tmp_path / 'none.tsv'}: no such file")):
        with pytest.raises(DataError, match=f"^{re.escape(said)}"):
            evaluate.main(["score", "--task", "pawsx", "--gold", str(gold_path), "--predictions", str(predictions)])


def test_score_real_pawsx_and_xnli(capsys, tmp_path):
    for task, name in (("pawsx", "dev-es.tsv"), ("xnli", "dev-ar.tsv")):
        gold = DATA / task / name
        if not gold.exists():
            pytest.skip("../shared/data is absent")
        with open(gold, newline="", encoding="utf-8") as f:
            labels = [row[2] for row in csv.reader(f, delimiter="\t")]
        first, second = evaluate.CLASSIFICATION_LABELS[task][:2]
        predicted = [second if label == first else first for label in labels[:10]] + labels[10:]  # 10 wrong
        result = run_score(capsys, task, gold, write(tmp_path / "p.txt", "\n".join(predicted) + "\n"))
        assert result["total"] == len(labels) and result["accuracy"] == (len(labels) - 10) / len(labels) * 100


def test_score_tagging(tmp_path, capsys):
    gold = write(tmp_path / "gold.tsv", "Anton\tB-PER\nlebt\tO\nin\tO\nBerlin\tB-LOC\n\nDie\tB-ORG\nUN\tI-ORG\n")
    predicted = write(tmp_path / "pred.tsv", "Anton\tB-PER\nlebt\tO\nin\tO\nBerlin\tB-ORG\n\nDie\tO\nUN\tI-ORG\n")
    result = run_score(capsys, "panx", gold, predicted)
    assert (result["correct_entities"], result["predicted_entities"], result["gold_entities"]) == (1, 3, 3)
    assert "bad.tsv:4: unknown label 'B-MISC'" in score_error(
        capsys, "panx", gold, write(tmp_path / "bad.tsv", "Anton\tB-PER\nlebt\tO\nin\tO\nBerlin\tB-MISC\n"))
    assert "bad.tsv:2: 1 tab-separated fields; expected token<TAB>label" in score_error(
        capsys, "panx", gold, write(tmp_path / "bad.tsv", "Anton\tB-PER\nlebt O\n"))
    assert "bad.tsv:1: 1 tab-separated fields; expected token<TAB>label" in score_error(
        capsys, "panx", write(tmp_path / "bad.tsv", "Anton\nlebt\n"), gold)  # gold without labels
    assert "2 sentences but" in score_error(capsys, "panx", gold, write(tmp_path / "bad.tsv", "Anton\tB-PER\n"))
    assert "gold.tsv:6 has other tokens" in score_error(
        capsys, "panx", gold, write(tmp_path / "bad.tsv", "Anton\tB-PER\nlebt\tO\nin\tO\nBerlin\tO\n\nDas\tO\nUN\tO\n"))
    pos_gold = write(tmp_path / "pos.tsv", "Der\tDET\nHund\tNOUN\n\nbellt\tVERB\n")
    pos_pred = write(tmp_path / "pos_pred.tsv", "Der\tDET\nHund\tVERB\n\nbellt\tVERB\n")
    result = run_score(capsys, "udpos", pos_gold, pos_pred)
    assert result["accuracy"] == 2 / 3 * 100 and result["f1"] == xtreme_tagging_f1(
        [["DET", "NOUN"], ["VERB"]], [["DET", "VERB"], ["VERB"]])["f1"]


def test_score_real_panx(capsys):
    gold = DATA / "ner" / "panx" / "dev-de.tsv"
    if not gold.exists():
        pytest.skip("../shared/data is absent")
    result = run_score(capsys, "panx", gold, gold)
    assert result["f1"] == 100.0 and result["gold_entities"] == result["correct_entities"] > 200


def test_score_qa(tmp_path, capsys):
    gold = write(tmp_path / "gold.json", json.dumps({"version": "1.1", "data": squad(
        ("q1", ["Der Hund"]), ("q2", ["北京"]))}))
    predictions = write(tmp_path / "pred.json", json.dumps({"q1": "Hund", "q2": "北京大学"}))
    squad_result = run_score(capsys, "xquad", gold, predictions, "--lang", "de")
    assert squad_result["exact_match"] == 0.0 and squad_result["lang"] == "de"
    assert run_score(capsys, "mlqa", gold, predictions, "--lang", "de")["exact_match"] == 50.0
    assert "--lang must be one of en, es, hi, vi, de, ar, zh for mlqa" in score_error(capsys, "mlqa", gold, predictions)
    mlqa_zh = write(tmp_path / "dev-context-zh-question-en.json", gold.read_text())
    assert "--lang is en, but" in score_error(capsys, "mlqa", mlqa_zh, predictions, "--lang", "en")
    assert score_error(capsys, "tydiqa", gold, write(tmp_path / "dup.json", '{"q1": "a", "q1": "b"}')).endswith(
        "/dup.json: duplicate key 'q1'")  # (said once: not wrapped in another refusal)
    assert score_error(capsys, "xquad", gold, write(tmp_path / "empty.json", " \n")).endswith("/empty.json: empty file")
    assert "expected a JSON object {question id: answer text}" in score_error(
        capsys, "xquad", gold, write(tmp_path / "bad.json", '{"q1": ["a"]}'))
    assert "bad.json:1: invalid JSON" in score_error(capsys, "xquad", gold, write(tmp_path / "bad.json", '{"q1"'))
    deep = write(tmp_path / "deep.json", "[" * 100_000 + "]" * 100_000)
    assert "deep.json: JSON nested deeper than Python reads" in score_error(capsys, "xquad", gold, deep)
    long = write(tmp_path / "long.json", '{"q1": "a", "n": ' + "9" * 5000 + "}")  # (Python converts 4,300 digits)
    assert "long.json: a number JSON holds that Python does not read" in score_error(capsys, "xquad", gold, long)
    no_answers = write(tmp_path / "g.json", json.dumps({"data": squad(("x", []))}))
    assert "question 'x' has no gold answer" in score_error(capsys, "xquad", no_answers, predictions)
    removed = write(tmp_path / "g.json", json.dumps({"data": squad(("x", [""]))}))  # a test file, answers removed
    assert "question 'x' has no gold answer" in score_error(capsys, "xquad", removed, predictions)
    blank = write(tmp_path / "g.json", json.dumps({"data": squad(("q1", ["Der Hund"]), ("q2", ["Hund", " "]))}))
    assert "question 'q2' has no gold answer to score against, or a blank one" in score_error(
        capsys, "xquad", blank, predictions)  # (an empty prediction scored exact match 1, F1 0)
    twice = write(tmp_path / "g.json", json.dumps({"data": squad(("q1", ["Hund"]), ("q1", ["Katze"]))}))
    assert "g.json: question 'q1': this id is used twice" in score_error(capsys, "xquad", twice, predictions)
    # Answers to another file's questions (no id in common): not a score of 0, a mistake said as such.
    for other in (json.dumps({"a1": "Hund", "a2": "Katze"}), "{}"):
        other = write(tmp_path / "other.json", other)
        assert "other.json: answers none of the questions of" in score_error(capsys, "xquad", gold, other)


def test_score_real_xquad_gold_answers(capsys, tmp_path):
    gold = DATA / "xquad" / "xquad.ar.json"
    if not gold.exists():
        pytest.skip("../shared/data is absent")
    data = json.loads(gold.read_text())["data"]
    predictions = {qa["id"]: qa["answers"][0]["text"] for a in data for p in a["paragraphs"] for qa in p["qas"]}
    result = run_score(capsys, "xquad", gold, write(tmp_path / "p.json", json.dumps(predictions)))
    assert (result["exact_match"], result["f1"], result["total"]) == (100.0, 100.0, 1190)


# ---------------------------------------------------------------------------------------------------
# The paper's analyses, on a tiny random model

def tiny_config(**changes):
    from model import ModelConfig
    return ModelConfig(**{**dict(vocab_size=60, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                 input_embedding_size=16, output_embedding_size=24, max_position_embeddings=64),
                          **changes})


def random_sentences(n, seed, low=5, high=60):
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def test_sentence_embeddings_mean_over_real_tokens_only():
    import torch
    from model import Encoder
    torch.manual_seed(0)
    encoder = Encoder(tiny_config())
    sentences = random_sentences(5, 0)
    batched = evaluate.sentence_embeddings(encoder, sentences, cls_id=1, sep_id=2, pad_id=0, max_len=16,
                                           batch_size=3)
    assert len(batched) == 3 and all(layer.shape == (5, 32) for layer in batched)
    for i, ids in enumerate(sentences):  # each sentence alone, no padding: the mean of states 1 .. T-2
        _, states = encoder.eval()(torch.tensor([[1] + ids + [2]]), output_hidden_states=True)
        for layer, h in enumerate(states):
            torch.testing.assert_close(batched[layer][i], h[0, 1:-1].mean(0), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sentence 1 has no tokens"):
        evaluate.sentence_embeddings(encoder, [[5], []], 1, 2, 0)
    with pytest.raises(ValueError, match="sentence 0 has no tokens"):  # none left within max_len
        evaluate.sentence_embeddings(encoder, [[5, 6, 7]], 1, 2, 0, max_len=2, batch_size=1)


def test_translation_accuracy_hand_worked():
    import torch
    source = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [6.0, 5.0], [5.0, 6.0]])
    shift = torch.tensor([10.0, -3.0])
    target = source + shift
    fit, test = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])
    assert evaluate.translation_accuracy(source, target, fit, test) == 100.0
    # The fitted vector (0, 0.9) misses the test pairs' shift (-0.6, 0). Test targets: (4.4, 5), (5.4, 5),
    # (4.4, 6); queries (5, 5.9), (6, 5.9), (5, 6.9) have squared distances (1.17, 0.97, 0.37),
    # (3.37, 1.17, 2.57), (3.97, 3.77, 1.17): the first retrieves the third target, the others their own.
    wrong = source.clone()
    wrong[:3] += torch.tensor([0.0, 0.9])
    wrong[3:] += torch.tensor([-0.6, 0.0])
    assert evaluate.translation_accuracy(source, wrong, fit, test) == pytest.approx(200.0 / 3)


def test_translation_probe_identical_text_is_perfect_at_every_layer():
    import torch
    from model import Encoder
    torch.manual_seed(0)
    config = tiny_config(num_layers=3)
    sentences = random_sentences(20, 1)
    accuracies = evaluate.translation_probe(Encoder(config), sentences, sentences, 1, 2, 0, max_len=16,
                                            batch_size=8)
    assert accuracies == [100.0] * (config.num_layers + 1)


def test_translation_probe_shuffled_targets_fail():
    import torch
    from model import Encoder
    torch.manual_seed(0)
    sentences = random_sentences(40, 2)
    # Target i is an unrelated sentence: chance level is 1 in 20 at every layer.
    accuracies = evaluate.translation_probe(Encoder(tiny_config()), sentences, sentences[1:] + sentences[:1],
                                            1, 2, 0, max_len=16, batch_size=8)
    assert len(accuracies) == 3 and max(accuracies) <= 25.0
    with pytest.raises(ValueError, match="at least 4"):
        evaluate.translation_probe(Encoder(tiny_config()), sentences[:3], sentences[:3], 1, 2, 0)


def test_translation_probe_reads_a_repeated_sentence_as_one_answer():
    """A text and itself, each sentence three times (as XNLI's premises are): every retrieval is right,
    although the nearest of three identical targets is not always the pair's own copy."""
    import torch
    from model import Encoder
    torch.manual_seed(0)
    sentences = random_sentences(10, 3) * 3
    accuracies = evaluate.translation_probe(Encoder(tiny_config()), sentences, sentences, 1, 2, 0, max_len=16)
    assert accuracies == [100.0] * 3


def test_mlm_accuracy_matches_a_direct_computation():
    import torch
    from model import MaskedLM
    torch.manual_seed(0)
    model = MaskedLM(tiny_config(pretraining_only_layers=1)).eval()
    B, T, P = 3, 10, 4
    input_ids = torch.randint(5, 60, (B, T))
    masked_positions = torch.randint(1, T, (B, P))
    masked_ids = torch.randint(5, 60, (B, P))
    weights = torch.ones(B, P)
    weights[2, 2:] = 0.0  # padding predictions
    logits, _ = model(input_ids)  # (B, T, V) at every position
    picked = logits[torch.arange(B)[:, None], masked_positions]  # (B, P, V)
    masked_ids[0, :2] = picked[0, :2].argmax(-1)  # make a few predictions right
    right = (picked.argmax(-1) == masked_ids).float()
    expected = 100.0 * (right * weights).sum().item() / weights.sum().item()
    batch = {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids),
             "attention_mask": torch.ones_like(input_ids), "masked_positions": masked_positions,
             "masked_ids": masked_ids, "masked_weights": weights}
    result = evaluate.mlm_accuracy(model, [batch, batch])
    assert result["predictions"] == 2 * 10 and result["accuracy"] == pytest.approx(expected)
    assert result["accuracy"] >= 100.0 * 2 / 10
    _, loss = model(**batch)
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)


def write_checkpoint(path, model, tokenizer=None, config=None):
    """A pretrain.py checkpoint directory of `model` with what its readers read: the weights and checkpoint.json."""
    import hashlib
    from dataclasses import asdict
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in Path(path).iterdir()}
    (Path(path) / "checkpoint.json").write_text(json.dumps({
        "step": 1, "config": asdict(config or model.config), "train_config": {}, "processes": 1, "sha256": digests,
        "tokenizer": tokenizer or {"path": "spm.model", "sha256": ""}}))
    return str(path)


def test_load_masked_lm_checkpoint(tmp_path):
    import torch
    from model import MaskedLM
    model = MaskedLM(tiny_config())
    loaded = from_checkpoint(write_checkpoint(tmp_path / "ckpt", model))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    with pytest.raises(ValueError, match="bad: the weights do not fit"):
        from_checkpoint(write_checkpoint(tmp_path / "bad", model, config=tiny_config(hidden_size=16)))
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pt")  # an earlier version's file, or another's
    with pytest.raises(ValueError, match="ckpt.pt: no checkpoint.json: an interrupted save, or not a pretrain.py"):
        from_checkpoint(tmp_path / "ckpt.pt")


def test_the_analyses_use_the_checkpoints_tokenizer_and_refuse_another(tmp_path, capsys, monkeypatch):
    import torch
    import data
    from model import MaskedLM
    ours, other = (data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), n, str(tmp_path / name)))
                   for n, name in ((500, "ours"), (400, "other")))
    model = MaskedLM(tiny_config(vocab_size=500))
    checkpoint = write_checkpoint(tmp_path / "ckpt", model, {"path": ours.model_file, "sha256": ours.sha256})
    command = ["mlm-accuracy", "--checkpoint", checkpoint,
               "--data", str(REPO / "sample_data" / "en.txt"), "--batches", "1", "--batch-size", "2", "--seq-len", "32"]
    code, out, err = as_script(capsys, monkeypatch, command)
    assert code == 0 and json.loads(out)["predictions"] > 0, err
    code, out, err = as_script(capsys, monkeypatch, command + ["--tokenizer", other.model_file])
    assert code == 2 and err.count("\n") == 1, err
    assert f"{other.model_file} is not the tokenizer {checkpoint} was trained with" in err
    # Another program's file (finetune.py's training state) is named as such, not sent for a tokenizer.
    torch.save({"model": model.state_dict(), "optimizer": {}, "step": 1, "rng": []}, tmp_path / "state.pt")
    command[command.index(checkpoint)] = str(tmp_path / "state.pt")
    code, out, err = as_script(capsys, monkeypatch, command)
    assert code == 2 and "state.pt: no checkpoint.json" in err, err


def test_the_analyses_refuse_a_missing_head_and_name_a_sentence_without_pieces(tmp_path, capsys):
    import shutil
    import data
    from checkpoints import save_hf
    from model import Encoder
    spm = data.train_tokenizer(str(REPO / "sample_data"), 500, str(tmp_path / "spm"))
    save_hf(Encoder(tiny_config(vocab_size=500)), tmp_path / "encoder")  # as a fine-tuned or released model
    shutil.copy(spm, tmp_path / "encoder" / "sentencepiece.model")
    with pytest.raises(DataError, match="encoder has no masked-LM head.*no masked-LM accuracy to measure"):
        evaluate.main(["mlm-accuracy", "--checkpoint", str(tmp_path / "encoder"), "--data",
                       str(REPO / "sample_data" / "en.txt"), "--device", "cpu"])
    source = write(tmp_path / "en.txt", "one\ntwo\nthree\nfour\n")
    target = write(tmp_path / "de.txt", "eins\nzwei\n\u200b\nvier\n")  # a zero-width space: no piece at all
    capsys.readouterr()
    with pytest.raises(DataError, match=r"de.txt: the sentence '\\u200b' has no pieces in"):
        evaluate.main(["translation-probe", "--checkpoint", str(tmp_path / "encoder"), "--source", str(source),
                       "--target", str(target), "--max-len", "32", "--device", "cpu"])
    assert capsys.readouterr().err == ""  # (the probe's summary comes with its figures: the refusal is all it says)
    # Sentences longer than --max-len are cut, which is said; the chance level is printed beside the figures.
    target = write(tmp_path / "de.txt", "eins\nzwei zwei zwei zwei zwei zwei zwei zwei\ndrei\nvier\n")
    with pytest.warns(UserWarning, match="1 of the 8 sentences have more pieces than --max-len 8 holds"):
        evaluate.main(["translation-probe", "--checkpoint", str(tmp_path / "encoder"), "--source", str(source),
                       "--target", str(target), "--max-len", "8", "--device", "cpu"])
    assert "retrieval among the other 2 (chance: 50.00%)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # more predictions than maskable positions: padding, for nothing
        evaluate.main(["mlm-accuracy", "--checkpoint", "x", "--data", "y", "--seq-len", "16"])
    assert "--max-predictions must be at most --seq-len - 2 (14)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # translation-probe's flag is not mlm-accuracy's
        evaluate.main(["mlm-accuracy", "--checkpoint", "x", "--data", "y", "--max-len", "64"])
    assert "unrecognized arguments: --max-len 64" in capsys.readouterr().err


def test_the_probe_reads_a_directory_s_encoder_alone(tmp_path, capsys, monkeypatch):
    """translation-probe builds no masked-LM head for a Hugging Face directory (the released RemBERT's would be 416M
    fresh parameters, 1.6 GB): a head the directory does not hold costs nothing, whatever size its config names, and
    a directory without a pooler (RemBertForMaskedLM saves none) is read without a word."""
    import shutil
    import data
    import model
    from safetensors.torch import load_file, save_file
    from checkpoints import save_hf
    spm = data.train_tokenizer(str(REPO / "sample_data" / "en.txt"), 300, str(tmp_path / "spm"))
    save_hf(model.Encoder(tiny_config(vocab_size=300)), tmp_path / "encoder")
    shutil.copy(spm, tmp_path / "encoder" / "sentencepiece.model")
    config = json.loads((tmp_path / "encoder" / "config.json").read_text())  # a head of 300 x 10^8: 112 GiB
    (tmp_path / "encoder" / "config.json").write_text(json.dumps({**config, "output_embedding_size": 10 ** 8}))
    weights = load_file(tmp_path / "encoder" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("pooler.")}, tmp_path / "encoder" / "model.safetensors")

    def no_head(*args):
        raise AssertionError("translation-probe built a masked-LM head")
    monkeypatch.setattr(model, "MLMHead", no_head)
    source = write(tmp_path / "en.txt", "one\ntwo\nthree\nfour\n")
    target = write(tmp_path / "de.txt", "eins\nzwei\ndrei\nvier\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate.main(["translation-probe", "--checkpoint", str(tmp_path / "encoder"), "--source", str(source),
                       "--target", str(target), "--max-len", "32", "--device", "cpu"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["pairs"] == 4


def test_parallel_text_whose_line_is_a_number_too_long_for_python_is_read_as_text(tmp_path):
    """json.loads refuses an integer of over 4,300 digits with a plain ValueError (a traceback, before): not JSON."""
    source = write(tmp_path / "a.txt", "1" * 5000 + "\nhello world\n")
    target = write(tmp_path / "b.txt", "x y\nhallo Welt\n")
    assert evaluate.read_parallel(source, target) == (["1" * 5000, "hello world"], ["x y", "hallo Welt"])


def test_read_parallel(tmp_path):
    source, target = DATA / "xquad" / "xquad.en.json", DATA / "xquad" / "xquad.de.json"
    if not source.exists():
        pytest.skip("../shared/data is absent")
    questions = evaluate.read_parallel(source, target)
    assert len(questions[0]) == len(questions[1]) == 1190
    contexts = evaluate.read_parallel(source, target, unit="contexts")
    assert len(contexts[0]) == 240 and contexts[0][0].startswith("The Panthers defense")
    lines = write(tmp_path / "a.txt", "one\ntwo\n"), write(tmp_path / "b.txt", "eins\n")
    with pytest.raises(ValueError, match="not parallel: 2 and 1 sentences"):
        evaluate.read_parallel(*lines)
    with pytest.raises(ValueError, match="two SQuAD-format .json files, or two text files"):
        evaluate.read_parallel(lines[0], source)  # the JSON's lines would be taken for sentences
    with pytest.raises(ValueError, match="--unit contexts pairs the paragraphs of SQuAD-format .json files"):
        evaluate.read_parallel(*lines, unit="contexts")
    # Files of another format, under a text file's name, are not read as sentences.
    squad = write(tmp_path / "xquad.en.txt", source.read_text())
    with pytest.raises(ValueError, match="xquad.en.txt: a JSON file; SQuAD-format files are read as such when named"):
        evaluate.read_parallel(squad, lines[1])
    # A number too long for Python's int (json.loads' plain ValueError) makes it no less a JSON file.
    squad.write_text(source.read_text().replace('"data":', '"n": ' + "1" * 5000 + ', "data":', 1))
    with pytest.raises(ValueError, match="xquad.en.txt: a JSON file; SQuAD-format"):
        evaluate.read_parallel(squad, lines[1])
    tsv = write(tmp_path / "dev-en.tsv", "premise\thypothesis\tlabel\nA man.\tA person.\tentailment\n")
    with pytest.raises(ValueError, match="dev-en.tsv:1: a tab: one sentence per line, not columns"):
        evaluate.read_parallel(tsv, lines[1])
