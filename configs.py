"""Every model of "Rethinking Embedding Coupling in Pre-trained Language Models", by name.

The multilingual models of Sections 3-6 are mBERT-sized (12 layers, H 768, 12 heads, a 120k
SentencePiece vocabulary) and differ only in their embeddings; the English BERT-base rows are from
the appendix (Table 13); `rembert` is the released model (Section 7). `python configs.py` prints the
pre-training and fine-tuning parameter counts of each beside the paper's.
"""

from dataclasses import asdict, replace

from model import ModelConfig

MBERT = ModelConfig(vocab_size=120_000, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                    input_embedding_size=768, output_embedding_size=768, tie_embeddings=False,
                    pretraining_only_layers=0, dropout=0.1)
BERT_BASE = replace(MBERT, vocab_size=30_000)


def mbert(**changes):
    return replace(MBERT, **changes)


CONFIGS = {
    # Table 2: coupling. The baseline ties the 768-wide input and output embeddings (mBERT).
    "coupled": mbert(tie_embeddings=True),
    "decoupled": mbert(),
    # Table 3: which embedding can shrink? The input one, at no cost.
    "ein768-eout128": mbert(output_embedding_size=128),
    "ein128-eout768": mbert(input_embedding_size=128),
    # Table 4: a larger output embedding (E_in 128) makes the kept layers better.
    "eout128": mbert(input_embedding_size=128, output_embedding_size=128),
    "eout3072": mbert(input_embedding_size=128, output_embedding_size=3072),
    # Table 5: the same capacity as 11 more Transformer layers, used in pre-training only.
    "extra-layers-11": mbert(input_embedding_size=128, output_embedding_size=128, pretraining_only_layers=11),
    # Table 6: the input-embedding parameters saved by E_in 128, reinvested in width or depth.
    "reinvest-h1024": mbert(input_embedding_size=128, hidden_size=1024, num_heads=16, intermediate_size=4096),
    "reinvest-l23": mbert(input_embedding_size=128, num_layers=23),
    # Table 12: coupled embeddings factorized ALBERT-style (E 128 < H, projected up and back).
    "coupled-e128": mbert(input_embedding_size=128, output_embedding_size=128, tie_embeddings=True),
    # Table 13: English BERT-base (30k WordPiece vocabulary) with larger output embeddings or layers.
    "bert-base": replace(BERT_BASE, tie_embeddings=True),
    "bert-eout128": replace(BERT_BASE, output_embedding_size=128),
    "bert-eout768": replace(BERT_BASE),
    "bert-eout3072": replace(BERT_BASE, output_embedding_size=3072),
    "bert-l15": replace(BERT_BASE, tie_embeddings=True, pretraining_only_layers=3),
    "bert-l24": replace(BERT_BASE, tie_embeddings=True, pretraining_only_layers=12),
    # Section 7: RemBERT, as released (google/rembert). Table 14 prints E_out 1536; the released
    # checkpoint has 1664, the only value that gives the paper's 995M pre-training parameters.
    "rembert": ModelConfig(vocab_size=250_300, hidden_size=1152, num_layers=32, num_heads=18,
                           intermediate_size=4608, input_embedding_size=256, output_embedding_size=1664,
                           tie_embeddings=False, pretraining_only_layers=0, dropout=0.0),
    # For CPU work: the same shape of model (E_in < H < E_out, decoupled), a few million parameters.
    "tiny": ModelConfig(vocab_size=8000, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512,
                        input_embedding_size=64, output_embedding_size=256, tie_embeddings=False,
                        pretraining_only_layers=0, max_position_embeddings=512, dropout=0.1),
    "small": ModelConfig(vocab_size=32_000, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
                         input_embedding_size=128, output_embedding_size=512, tie_embeddings=False,
                         pretraining_only_layers=0, dropout=0.1),
}

# (pre-training, fine-tuning) parameters as the paper prints them.
PAPER_PARAMETERS = {
}


def main():
    import torch
    from model import MaskedLM, count_parameters

    print(f"{'config':<16} {'L':>3} {'+L':>3} {'H':>5} {'E_in':>5} {'E_out':>5} {'tied':>5} {'vocab':>8} "
          f"{'PT':>9} {'FT':>9} {'paper PT':>9} {'paper FT':>9}")
    for name, config in CONFIGS.items():
        with torch.device("meta"):  # shapes only: no memory, even for RemBERT
            counts = count_parameters(MaskedLM(config))
        paper = PAPER_PARAMETERS.get(name)
        pt, ft = (f"{paper[0] / 1e6:.0f}M", f"{paper[1] / 1e6:.0f}M") if paper else ("", "")
        print(f"{name:<16} {config.num_layers:>3} {config.pretraining_only_layers:>3} {config.hidden_size:>5} "
              f"{config.input_embedding_size:>5} {config.output_embedding_size:>5} "
              f"{str(config.tie_embeddings):>5} {config.vocab_size:>8} "
              f"{counts['pretraining'] / 1e6:>8.1f}M {counts['finetuning'] / 1e6:>8.1f}M {pt:>9} {ft:>9}")


if __name__ == "__main__":
    main()
