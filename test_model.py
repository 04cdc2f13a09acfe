"""Tests of model.py: parity with transformers' RemBERT, every embedding variant, heads, counts."""

import warnings
from dataclasses import replace

import pytest
import torch

from configs import CONFIGS
from checkpoints import from_hf, save_hf
from model import Encoder, MaskedLM, ModelConfig, SequenceClassifier, SpanExtractor, TokenClassifier, count_parameters

SMALL = ModelConfig(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64,
                    input_embedding_size=16, output_embedding_size=48, tie_embeddings=False,
                    pretraining_only_layers=0, max_position_embeddings=40, type_vocab_size=2, dropout=0.0)


def batch(config, B=3, T=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (B, T), generator=g)
    token_type_ids = (torch.arange(T) >= T // 2).long().expand(B, T).clone()
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[B // 2, T - 4:] = 0  # a padded row
    return input_ids, token_type_ids, attention_mask


def hf_config(config, **extra):
    transformers = pytest.importorskip("transformers")
    return transformers.RemBertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
        input_embedding_size=config.input_embedding_size, output_embedding_size=config.output_embedding_size,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=config.layer_norm_eps,
        bos_token_id=1, eos_token_id=2, **extra)


# --------------------------------------------------------------------------------------------
# Parity with Hugging Face's implementation (random weights, small configs, no download)

@pytest.mark.parametrize("config, token", [(SMALL, 1), (replace(SMALL, output_embedding_size=16), 1), (SMALL, 2)],
                         ids=["eout>ein", "eout<h", "mask-value-2"])
def test_masked_lm_matches_transformers(tmp_path, config, token):
    """Hidden states, logits and the masked-LM loss; any non-zero mask value is a token, a -100 label no prediction."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.RemBertForMaskedLM(hf_config(config)).eval()
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    input_ids, token_type_ids, attention_mask = batch(config)
    attention_mask = token * attention_mask
    labels = torch.full_like(input_ids, -100)
    labels[:, 2:5] = input_ids[:, 2:5]
    every_position = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        ref = hf(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask, labels=labels,
                 output_hidden_states=True)
        hidden, states = ours.encoder(input_ids, token_type_ids, attention_mask, output_hidden_states=True)
        logits, loss = ours(input_ids, token_type_ids, attention_mask, every_position, labels)
    real = attention_mask.bool()
    for layer in range(config.num_layers + 1):  # 0: the embeddings projected to H, in both
        torch.testing.assert_close(states[layer][real], ref.hidden_states[layer][real], atol=1e-5, rtol=1e-5)
    logits = logits.unflatten(0, input_ids.shape)  # (B*T, V): the rows of every_position, bert's layout
    torch.testing.assert_close(logits[real], ref.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=1e-5)


def test_encoder_and_heads_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.RemBertModel(hf_config(SMALL)).eval()  # with the pooler
    hf.save_pretrained(tmp_path / "base")
    ours = from_hf(tmp_path / "base", Encoder).eval()
    input_ids, token_type_ids, attention_mask = batch(SMALL)
    with torch.no_grad():
        ref = hf(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        hidden = ours(input_ids, token_type_ids, attention_mask)
        torch.testing.assert_close(hidden, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.pool(hidden), ref.pooler_output, atol=1e-5, rtol=1e-5)

    # Our task heads, exported, load into transformers' classes and give the same logits.
    heads = {
        "RemBertForSequenceClassification": SequenceClassifier(ours, num_labels=3),
        "RemBertForTokenClassification": TokenClassifier(ours, num_labels=7),
        "RemBertForQuestionAnswering": SpanExtractor(ours),
    }
    # With labels, the same losses: answer positions shaped (B, 1), one past the window (ignored), one negative.
    B, T = input_ids.shape
    tags = torch.randint(0, 7, (B, T)).masked_fill(attention_mask == 0, -100)
    labels = {"RemBertForSequenceClassification": {"labels": torch.tensor([[0], [2], [1]])},  # (B, 1), as (B,)
              "RemBertForTokenClassification": {"labels": tags},
              "RemBertForQuestionAnswering": {"start_positions": torch.tensor([[3], [T + 4], [-1]]),
                                              "end_positions": torch.tensor([[5], [T], [2]])}}
    for name, head in heads.items():
        head.eval()
        save_hf(head, tmp_path / name)
        theirs = getattr(transformers, name).from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            mine = head(input_ids, token_type_ids, attention_mask, *labels[name].values())
            ref = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                         **{key: value.clone() for key, value in labels[name].items()})  # (they clamp in place)
        if name == "RemBertForQuestionAnswering":
            torch.testing.assert_close(mine[0], ref.start_logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine[1], ref.end_logits, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(mine[0], ref.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine[-1], ref.loss, atol=1e-5, rtol=1e-5)


def test_coupled_shares_one_tensor():
    config = replace(SMALL, input_embedding_size=24, output_embedding_size=24, tie_embeddings=True)
    model = MaskedLM(config)
    assert model.head.decoder.weight is model.encoder.embeddings.word_embeddings.weight
    decoupled = MaskedLM(replace(config, tie_embeddings=False))
    saved = config.vocab_size * 24
    assert count_parameters(decoupled)["pretraining"] - count_parameters(model)["pretraining"] == saved
    assert count_parameters(decoupled)["finetuning"] == count_parameters(model)["finetuning"]
    # A gradient step through the output embedding moves the input embedding.
    input_ids, token_type_ids, attention_mask = batch(config)
    _, loss = model(input_ids, token_type_ids, attention_mask, masked_positions=torch.tensor([[1, 2]] * 3),
                    masked_ids=torch.tensor([[7, 8]] * 3))
    loss.backward()
    assert model.encoder.embeddings.word_embeddings.weight.grad[7].abs().sum() > 0


def test_pretraining_only_layers_vanish_for_fine_tuning():
    config = replace(SMALL, pretraining_only_layers=2)
    model = MaskedLM(config).eval()
    assert len(model.pretraining_layers) == 2 and len(model.encoder.layers) == config.num_layers
    counts = count_parameters(model)
    base = count_parameters(MaskedLM(SMALL))
    layer = sum(p.numel() for p in model.pretraining_layers[0].parameters())
    assert counts["pretraining"] == base["pretraining"] + 2 * layer
    assert counts["finetuning"] == base["finetuning"]
    # The extra layers change the MLM output but not the encoder's.
    input_ids, token_type_ids, attention_mask = batch(config)
    with torch.no_grad():
        hidden = model.encoder(input_ids, token_type_ids, attention_mask)
        logits, _ = model(input_ids, token_type_ids, attention_mask)
        without = model.head(hidden)
    assert not torch.allclose(logits, without)
    assert set(Encoder(config).state_dict()) == {k[len("encoder."):] for k in model.state_dict()
                                                 if k.startswith("encoder.")}


def test_input_projection_only_when_sizes_differ():
    assert isinstance(Encoder(SMALL).embedding_projection, torch.nn.Linear)
    same = replace(SMALL, input_embedding_size=SMALL.hidden_size)
    assert isinstance(Encoder(same).embedding_projection, torch.nn.Identity)
    assert Encoder(SMALL).embeddings.word_embeddings.weight.shape == (97, 16)
    assert MaskedLM(SMALL).head.decoder.weight.shape == (97, 48)


@pytest.mark.parametrize("extra_layers", [0, 2])
def test_head_at_masked_positions_equals_full_then_gather(extra_layers):
    """google-research/bert's gather: the head run at the masked positions alone gives the logits, loss and
    gradients of the whole sequence's computation gathered afterwards (padding row included)."""
    torch.manual_seed(0)
    model = MaskedLM(replace(SMALL, pretraining_only_layers=extra_layers))
    params = [p for name, p in model.named_parameters() if not name.startswith("encoder.pooler.")]
    input_ids, token_type_ids, attention_mask = batch(SMALL)
    positions = torch.tensor([[0, 3, 5, 0], [2, 2, 6, 1], [10, 9, 8, 7]])
    targets = torch.randint(0, SMALL.vocab_size, positions.shape, generator=torch.Generator().manual_seed(1))
    gathered, loss = model(input_ids, token_type_ids, attention_mask, masked_positions=positions, masked_ids=targets)
    full, _ = model(input_ids, token_type_ids, attention_mask)
    full = full[torch.arange(3)[:, None], positions]
    full_loss = torch.nn.functional.cross_entropy(full.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(gathered, full.flatten(0, 1))  # (B*P, V): bert's rows
    torch.testing.assert_close(loss, full_loss)
    for ours, reference in zip(torch.autograd.grad(loss, params), torch.autograd.grad(full_loss, params)):
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-4)


def test_masked_lm_loss_weights():
    model = MaskedLM(SMALL).eval()
    input_ids, token_type_ids, attention_mask = batch(SMALL)
    positions = torch.tensor([[1, 2, 0]] * 3)
    ids = torch.tensor([[5, 6, 0]] * 3)
    weights = torch.tensor([[1.0, 1.0, 0.0]] * 3)
    with torch.no_grad():
        logits, loss = model(input_ids, token_type_ids, attention_mask, positions, ids, weights)
    logits = logits.unflatten(0, positions.shape)  # (B*P, V): bert's rows
    expected = torch.nn.functional.cross_entropy(logits[:, :2].reshape(-1, 97), ids[:, :2].reshape(-1))
    torch.testing.assert_close(loss, expected)
    with torch.no_grad():  # all weights zero (an empty batch): a finite zero loss, not NaN
        _, loss = model(input_ids, token_type_ids, attention_mask, positions, ids, torch.zeros(3, 3))
    assert loss.item() == 0.0


def test_padding_does_not_change_real_tokens():
    model = MaskedLM(SMALL).eval()
    input_ids, token_type_ids, _ = batch(SMALL, B=1, T=7)
    padded_ids = torch.cat([input_ids, torch.full((1, 5), 3)], 1)
    padded_types = torch.cat([token_type_ids, torch.zeros(1, 5, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 5)], 1).long()
    with torch.no_grad():
        short, _ = model(input_ids, token_type_ids, torch.ones(1, 7, dtype=torch.long))
        long, _ = model(padded_ids, padded_types, mask)
        all_padding = model.encoder(padded_ids, padded_types, torch.zeros_like(mask))
    torch.testing.assert_close(long[:, :7], short, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(all_padding).all()  # a fully padded evaluation row stays finite


# --------------------------------------------------------------------------------------------
# Task heads

def test_heads_compute_their_losses():
    torch.manual_seed(0)
    encoder = Encoder(SMALL)
    input_ids, token_type_ids, attention_mask = batch(SMALL)
    cross_entropy = torch.nn.functional.cross_entropy
    labels = torch.tensor([0, 2, 1])
    logits, loss = SequenceClassifier(encoder, 3)(input_ids, token_type_ids, attention_mask, labels=labels)
    assert logits.shape == (3, 3)
    torch.testing.assert_close(loss, cross_entropy(logits, labels))
    labels = torch.full((3, 11), -100)
    labels[:, 1] = 4
    logits, loss = TokenClassifier(encoder, 7)(input_ids, token_type_ids, attention_mask, labels=labels)
    assert logits.shape == (3, 11, 7)
    torch.testing.assert_close(loss, cross_entropy(logits[:, 1], labels[:, 1]))
    _, loss = TokenClassifier(encoder, 7)(input_ids, labels=torch.full((3, 11), -100))  # no word fits: a zero loss
    assert loss.item() == 0.0
    starts, ends = torch.tensor([1, 0, 3]), torch.tensor([2, 0, 5])
    start, end, loss = SpanExtractor(encoder)(input_ids, token_type_ids, attention_mask, starts, ends)
    assert start.shape == end.shape == (3, 11)
    torch.testing.assert_close(loss, (cross_entropy(start, starts) + cross_entropy(end, ends)) / 2)
    assert SpanExtractor(encoder)(input_ids)[-1] is None
    with pytest.raises(ValueError, match="at least 2 labels"):  # one class: cross-entropy 0, nothing learnt
        SequenceClassifier(encoder, 1)


def test_heads_train_on_a_toy_task():
    """The classifier learns a rule the encoder can see (first token parity) in a few steps."""
    torch.manual_seed(0)
    model = SequenceClassifier(Encoder(SMALL), 2, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    input_ids = torch.randint(5, 97, (32, 6))
    labels = input_ids[:, 1] % 2
    for _ in range(60):
        optimizer.zero_grad()
        _, loss = model(input_ids, labels=labels)
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


# --------------------------------------------------------------------------------------------
# Configurations and the paper's parameter accounting

@pytest.mark.parametrize("changes, message", [
    (dict(num_heads=5), "not divisible by num_heads"),
    (dict(tie_embeddings=True), "input_embedding_size == output_embedding_size"),
    (dict(num_layers=0), "num_layers must be an int >= 1, got 0"),
    (dict(pretraining_only_layers=-1), "pretraining_only_layers must be an int >= 0, got -1"),
    (dict(hidden_size=32.0), "hidden_size must be an int >= 1, got 32.0"),
    (dict(dropout=1.0), "dropout"),
])
def test_impossible_configs_fail_clearly(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(SMALL, **changes)


def test_sequence_longer_than_positions_fails_clearly():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Encoder(SMALL)(torch.zeros(1, 41, dtype=torch.long))


def test_rembert_counts_equal_transformers():
    transformers = pytest.importorskip("transformers")
    config = CONFIGS["rembert"]
    with torch.device("meta"):
        counts = count_parameters(MaskedLM(config))
        hf_config_ = hf_config(config)
        hf_config_.vocab_size = config.vocab_size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_base = transformers.RemBertModel(hf_config_)
            hf_mlm = transformers.RemBertForMaskedLM(hf_config_)
    assert counts["finetuning"] == 575_920_384 == hf_base.num_parameters()
    # RemBertForMaskedLM has no pooler; our pre-training count keeps it (it survives into fine-tuning).
    pooler = config.hidden_size * config.hidden_size + config.hidden_size
    assert counts["pretraining"] == hf_mlm.num_parameters() + pooler
    assert abs(counts["pretraining"] - 995e6) / 995e6 < 0.005


def test_every_paper_config_is_within_two_percent_of_the_paper():
    from configs import PAPER_PARAMETERS, parameter_counts
    assert set(PAPER_PARAMETERS) == set(CONFIGS) - {"tiny", "small"}
    for name, paper in PAPER_PARAMETERS.items():
        counts = parameter_counts(name)
        for ours, theirs in zip((counts["pretraining"], counts["finetuning"]), paper):
            assert abs(ours / 1e6 - theirs) / theirs < 0.02, (name, ours, theirs)
    # The paper's fixed points: decoupling keeps the fine-tuning model; E_out never reaches it.
    assert parameter_counts("coupled")["finetuning"] == parameter_counts("decoupled")["finetuning"]
    eout = [parameter_counts(n) for n in ("eout128", "ein128-eout768", "eout3072", "extra-layers-11")]
    assert len({c["finetuning"] for c in eout}) == 1
    assert eout[0]["pretraining"] < eout[1]["pretraining"] < eout[2]["pretraining"]


def test_the_parameter_table_takes_no_flags(capsys):
    import configs
    with pytest.raises(SystemExit) as exit:
        configs.main(["--config", "rembert"])  # a flag the table does not have is named, not ignored
    assert exit.value.code == 2 and "unrecognized arguments: --config rembert" in capsys.readouterr().err
    configs.main([])
    assert "rembert" in capsys.readouterr().out
