"""Every model of "Rethinking Embedding Coupling in Pre-trained Language Models", by name, and the
command-line convention all the scripts share.

The multilingual models of Sections 4-5 (Tables 2-6) are mBERT-sized (12 layers, H 768, 12 heads, a 120k
SentencePiece vocabulary) and differ in their embeddings and layers; the English BERT-base rows are from the appendix
(Tables 12-13); `rembert` is the released model (Section 5, Appendix A.7). `python configs.py` prints the pre-training
and fine-tuning parameter counts of each beside the paper's.
"""

import argparse
import importlib.util
import math
import os
import sys
import typing
import unicodedata
import warnings
from dataclasses import MISSING, field, fields, replace
from functools import partial

import torch
import torch.distributed as dist

from checkpoints import DataError
from model import MaskedLM, ModelConfig, count_parameters

# mBERT's shape (Appendix A.2). The paper's models use no dropout (A.2, following ALBERT).
MBERT = ModelConfig(vocab_size=120_000, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                    input_embedding_size=768, output_embedding_size=768, dropout=0.0)
# English BERT-base (Appendix A.6): a 30k vocabulary, BERT's dropout.
BERT_BASE = replace(MBERT, vocab_size=30_000, dropout=0.1)
mbert, bert = partial(replace, MBERT), partial(replace, BERT_BASE)  # a row: the shape with its changes

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
    # Table 5: the capacity of E_out 768 spent instead on 11 more layers, used in pre-training only.
    "extra-layers-11": mbert(input_embedding_size=128, output_embedding_size=128, pretraining_only_layers=11),
    # Table 6: the input-embedding parameters saved by E_in 128, reinvested in width or depth.
    "reinvest-h1024": mbert(input_embedding_size=128, hidden_size=1024, num_heads=16, intermediate_size=4096),
    "reinvest-l23": mbert(input_embedding_size=128, num_layers=23),
    # Table 12: coupled embeddings factorized ALBERT-style (E 128 < H, projected up and back).
    "coupled-e128": mbert(input_embedding_size=128, output_embedding_size=128, tie_embeddings=True),
    # Table 12 (English row): BERT-base itself, coupled at E 768.
    "bert-base": bert(tie_embeddings=True),
    # Table 13: English BERT-base decoupled with E_in 128, then a larger E_out or pre-training-only layers
    # (L=15, L=24: 3 or 12 layers on top of the 12 kept, with E_out 128).
    "bert-eout128": bert(input_embedding_size=128, output_embedding_size=128),
    "bert-eout768": bert(input_embedding_size=128),
    "bert-eout3072": bert(input_embedding_size=128, output_embedding_size=3072),
    "bert-l15": bert(input_embedding_size=128, output_embedding_size=128, pretraining_only_layers=3),
    "bert-l24": bert(input_embedding_size=128, output_embedding_size=128, pretraining_only_layers=12),
    # Section 5 and Table 14: RemBERT, as released (google/rembert). Table 14 prints E_out 1536; the
    # released checkpoint has 1664, the only value that gives the paper's 995M pre-training parameters.
    "rembert": ModelConfig(vocab_size=250_300, hidden_size=1152, num_layers=32, num_heads=18, intermediate_size=4608,
                           input_embedding_size=256, output_embedding_size=1664, dropout=0.0),
    # For CPU work: the same shape of model (E_in < H < E_out, decoupled, no dropout), a few million parameters.
    "tiny": ModelConfig(vocab_size=8000, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512,
                        input_embedding_size=64, output_embedding_size=256, dropout=0.0),
    "small": ModelConfig(vocab_size=32_000, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
                         input_embedding_size=128, output_embedding_size=512, dropout=0.0),
}

# (pre-training, fine-tuning) parameters in millions, as the paper prints them.
PAPER_PARAMETERS = {
    "coupled": (177, 177), "decoupled": (269, 177),                              # Table 2
    "ein768-eout128": (192, 177), "ein128-eout768": (192, 100),                  # Table 3
    "eout128": (115, 100), "eout3072": (469, 100),                               # Table 4
    "extra-layers-11": (193, 100),                                               # Table 5
    "reinvest-h1024": (260, 168), "reinvest-l23": (270, 178),                    # Table 6
    "coupled-e128": (100, 100), "bert-base": (110, 110),                         # Table 12
    "bert-eout128": (93, 89), "bert-eout768": (112, 89), "bert-eout3072": (181, 89),
    "bert-l15": (114, 89), "bert-l24": (178, 89),                                # Table 13
    "rembert": (995, 575),                                                       # Table 7, A.7
}


def parameter_counts(name):
    """count_parameters of CONFIGS[name], built on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return count_parameters(MaskedLM(CONFIGS[name]))


def resolve_device(device):
    """auto -> cuda if torch sees a GPU, else xla if PJRT_DEVICE is set (TPU VM), else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "xla" if os.environ.get("PJRT_DEVICE") else "cpu"
    elif device not in ("cpu", "cuda", "xla"):
        raise ValueError(f"--device must be auto, cpu, cuda or xla, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA GPU (a CPU-only build of torch, or no driver?)")
    if device == "xla" and importlib.util.find_spec("torch_xla") is None:
        raise ValueError("--device xla needs torch-xla (auto is xla where PJRT_DEVICE is set): pip install "
                         "torch==2.9.0 torch-xla==2.9.0 (PJRT_DEVICE=TPU on a TPU VM, CPU to try it), or --device cpu")
    return device


# What a flag's values may be: (test, words for the error). A NaN fails every test.
POSITIVE = (lambda v: 0 < v < math.inf, "a positive number")
FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
GIVEN = (bool, "given")  # a value at all (a list: at least one)
SEED = (lambda v: 0 <= v < 2 ** 32, "an integer in [0, 2^32)")  # torch.manual_seed takes seed + rank
DEVICE = (resolve_device, "auto, cpu, cuda or xla")  # resolve_device says why a device cannot be used


def at_least(low):
    return (lambda v: low <= v < math.inf, f"a number >= {low}")


def one_of(names):
    return (lambda v: v in names, f"one of {', '.join(names)}")


def flag(default, help, check=None):
    """A dataclass field that is also a --flag: its default, its help, and the check of its values (a list's: each)."""
    default_arg = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(**default_arg, metadata={"help": help, "check": check})


def check_flags(instance):
    """Every field's check (see `flag`): a ValueError that names the first flag whose value fails."""
    for f in fields(instance):
        test, words = f.metadata.get("check") or (None, "")
        value, name = getattr(instance, f.name), "--" + f.name.replace("_", "-")
        listed = typing.get_origin(f.type) is list
        values = value if listed and test is not bool else [value]  # (a str is no list)
        if test and not all(map(test, values)):
            raise ValueError(f"{name} must be {words}" + (f", got {value!r}" if value not in ("", []) else ""))
        if f.type is int and not abs(value) < 2 ** 63:  # (a count past any run: torch and islice take 64 bits)
            raise ValueError(f"{name} must be below 2^63")
        if listed and len(set(value)) < len(value):  # (two runs of one --lr, one --seeds or one model: one folder)
            raise ValueError(f"{name} repeats a value ({' '.join(map(str, value))})")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (the whole usage is what --help shows)."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {printable(message)}\n")


def add_flags(parser, cls, default_none=False):
    """One --flag per field of the dataclass `cls`, typed as the field: a bool is --flag / --no-flag, a list takes
    one or more values. default_none: every default is None (overrides of a preset; None: not given)."""
    for f in fields(cls):
        default = None if default_none else f.default_factory() if f.default_factory is not MISSING else f.default
        kind = ({"action": argparse.BooleanOptionalAction} if f.type is bool else
                {"nargs": "+", "type": typing.get_args(f.type)[0]} if typing.get_origin(f.type) is list else
                {"type": f.type})
        shown = "" if default_none or default in (None, "", []) or f.type is bool else f" (default: {default})"
        parser.add_argument("--" + f.name.replace("_", "-"), default=default,
                            help=(f.metadata["help"] + shown).replace("%", "%%"), **kind)  # (help is %-formatted)


def parse_flags(parser, argv=None):
    """{field: value}; a flag given twice is refused (argparse keeps the last: `--eval a --eval b` would evaluate b)."""
    argv = sys.argv[1:] if argv is None else argv
    given = [a.split("=")[0].replace("--no-", "--") for a in argv if str(a).startswith("--")]
    if repeated := next((a for a in given if given.count(a) > 1), None):
        parser.error(f"{repeated} is given twice; give each flag once (a list takes its values at once: A B)")
    return vars(parser.parse_args(argv))


def build(parser, cls, values):
    """cls from the values of its fields' flags; a value it refuses (its __post_init__ says why) is an error."""
    try:
        return cls(**{f.name: values[f.name] for f in fields(cls)})
    except ValueError as e:
        parser.error(str(e))


def parse_command_line(doc, commands, argv=None):
    """The whole command line of a script: `commands` is a dataclass, or {name: dataclass} for a script
    whose first word picks one (python evaluate.py score --task ...). Returns (name or None, instance)."""
    parser, argv = ArgumentParser(description=doc), sys.argv[1:] if argv is None else argv
    if isinstance(commands, dict):
        if argv[:1] not in ([name] for name in [*commands, "-h", "--help"]):  # (argparse reads a flag's value as one)
            parser.error(f"the first word must be the command, one of {', '.join(commands)}; then its flags")
        words = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
        for name, cls in commands.items():
            add_flags(words.add_parser(name, help=cls.__doc__.split("\n")[0], description=cls.__doc__), cls)
    else:
        add_flags(parser, commands)
    values = parse_flags(parser, argv)
    name = values.get("command")
    return name, build(parser, commands[name] if name else commands, values)


def run_script(main):
    """Run a script's main(): a user's mistake (bad data, a missing file, a setting that cannot work) ends it
    with one line and exit code 2, not a traceback."""
    for stream in (sys.stdout, sys.stderr):  # a path or text the terminal's encoding cannot show: escaped
        stream.reconfigure(errors="backslashreplace")
    warnings.formatwarning = lambda message, *_: f"{sys.argv[0]}: warning: {printable(str(message))}\n"  # one line
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: checkpoints, results and predictions are written whole or not at all
        print(f"{sys.argv[0]}: interrupted", file=sys.stderr)
        sys.exit(130)
    except (ValueError, OSError, FloatingPointError, RuntimeError, MemoryError) as e:  # (a DataError is a ValueError)
        said = str(e)
        if isinstance(e, (DataError, OSError, FloatingPointError)):
            message = said
        elif dist.is_initialized() and dist.get_world_size() > 1 and (
                isinstance(e, dist.DistError) or "closed by peer" in said or "reset by peer" in said):
            message = "another process stopped: see its message"  # (gloo's and NCCL's words for a process that ended)
        elif isinstance(e, (torch.OutOfMemoryError, MemoryError)) or any(  # on CPU, XLA: a RuntimeError, by its text
                s in said.lower() for s in ("can't allocate memory", "out of memory", "resource_exhausted",
                                            "size calculation overflowed", "array is too big")):  # (torch's, numpy's)
            first = (said.splitlines() or [type(e).__name__])[0]  # (a MemoryError may say nothing)
            message = f"out of memory ({first}); a smaller model, batch size or sequence length needs less"
        else:
            raise
        sys.stderr.write(f"{sys.argv[0]}: error: {printable(message)}\n")  # (one write: processes do not interleave)
        if dist.is_initialized() and dist.get_world_size() > 1:  # gloo's threads may abort the interpreter's exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)  # (the line is said and every file written whole: nothing is left to do)
        sys.exit(2)


def printable(text):
    """A message as one line: the control characters and line breaks in a name it quotes as Python escapes them."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in text)


def main(argv=None):
    parse_flags(ArgumentParser(description=__doc__), argv)  # no flags: --help, or one line naming an unknown argument
    row = "{:<16} {:>3} {:>3} {:>5} {:>5} {:>5} {:>5} {:>8} {:>9} {:>9} {:>9} {:>9}".format
    print(row("config", "L", "+L", "H", "E_in", "E_out", "tied", "vocab", "PT", "FT", "paper PT", "paper FT"))
    for name, c in CONFIGS.items():
        counts = parameter_counts(name)
        paper = [f"{n}M" for n in PAPER_PARAMETERS[name]] if name in PAPER_PARAMETERS else ["", ""]
        print(row(name, c.num_layers, c.pretraining_only_layers, c.hidden_size, c.input_embedding_size,
                  c.output_embedding_size, str(c.tie_embeddings), c.vocab_size,
                  f"{counts['pretraining'] / 1e6:.1f}M", f"{counts['finetuning'] / 1e6:.1f}M", *paper))


if __name__ == "__main__":
    main()
