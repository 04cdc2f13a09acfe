"""The files of RemBERT models: a run's --out-dir (`RunFolder`, pretrain.py's and finetune.py's), pretrain.py's
checkpoints read as models, and transformers' RemBERT layout both ways (the released checkpoint reads with `from_hf`).
model.py holds the method; this file, what is written to disk (through one writer, `write_file`) and read back.

A training state is data, never code: it is read only after `read_checkpoint_info` has checked every file, and its
pickled metadata by an unpickler that admits the checkpoint library's own classes alone.
"""

import enum
import errno
import glob
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import stat
import typing
import warnings
import zipfile
from bisect import bisect_left
from collections import Counter
from dataclasses import asdict, fields

import torch
import torch.distributed.checkpoint as dcp

from model import Encoder, MaskedLM, ModelConfig, SequenceClassifier, SpanExtractor, TokenClassifier


class DataError(ValueError):
    """Bad input: a data file, a checkpoint or a Hugging Face directory. The message names it."""


def sha256(path):
    with open_input(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def open_input(path, named=""):
    """A file to read (bytes), or one line naming it (`named`: as the user did, "--train x.tsv"): not there, or not a
    regular file (a FIFO would block its reader, /dev/zero never end). Opened without blocking, then checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DataError(f"{named or path}: no such file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{named or path}: not a regular file (a directory, a FIFO or a device): not read")
    return open(fd, "rb")


def read_text(path):
    """A whole task file (they are small) as text, "\\r\\n" as "\\n"; a non-UTF-8 byte names its line."""
    with open_input(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    if not text.strip():
        raise DataError(f"{path}: empty file")
    if (cr := text.find("\r")) >= 0:  # old Mac line endings: the whole file would be one line
        raise DataError(f"{path}:{text.count(chr(10), 0, cr) + 1}: a carriage return without a line feed")
    return text


def read_json(path):
    """A JSON file; duplicate keys are an error rather than silently keeping the last one."""
    text = read_text(path)

    def no_duplicates(pairs):
        if duplicated := [k for k, n in Counter(k for k, _ in pairs).items() if n > 1]:
            raise DataError(f"{path}: duplicate key {duplicated[0]!r}")
        return dict(pairs)
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested deeper than Python reads") from None
    except DataError:  # (a key twice)
        raise
    except ValueError as e:  # (an integer of over 4,300 digits, which Python does not convert)
        raise DataError(f"{path}: a number JSON holds that Python does not read ({e})") from None


def write_file(path, write, mode="w"):
    """The one writer of a file: whole or not at all (a crash, a full disk, another process writing it), through a
    temporary file of ours, renamed; what a failed write left is removed. write(f) fills the open file f."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"{path}: saving failed ({one_line(e)})") from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    write_file(path, lambda f: json.dump(obj, f, indent=2))


def load_checkpoint(path):
    """torch.load, after checking the CRC-32 of every record (torch.load does not: a damaged file would give wrong
    weights): a Hugging Face directory's pytorch_model.bin. (Training states are never torch.save's.)"""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged:
            raise DataError(f"{path}: damaged: its record {damaged} fails its CRC check")
        return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, DataError):
        raise
    except pickle.UnpicklingError:  # (weights_only's refusal: several lines, which advise loading it unsafely)
        raise DataError(f"{path}: refused: its pickle holds more than tensors (objects or code, never loaded here), "
                        f"or is damaged") from None
    except Exception as e:  # whatever a damaged zip or pickle raises (BadZipFile, zlib.error, EOFError...)
        raise DataError(f"{path}: damaged or not a checkpoint (torch.save's zip) ({one_line(e)})") from None


def check_finite(path, tensors):
    """A DataError naming the first of the {name: tensor} that holds NaN or an infinity: a damaged or diverged model,
    of no use to train or measure."""
    if bad := next((name for name, t in tensors.items() if not t.isfinite().all()), None):
        raise DataError(f"{path}: {bad} holds NaN or infinite values")


# pretrain.py's checkpoint directories: read, checked first

CHECKPOINT_INFO = "checkpoint.json"  # pretrain.py writes it last: a directory without it is an interrupted save
CHECKPOINT_NAME = re.compile(r"ckpt-(\d{8})")  # a pre-training run's own folders: ckpt-STEP, 8 digits
STATES = "ckpt-" + "[0-9]" * 8  # (the same, as a glob)
_INFO_TYPES = {"step": int, "config": dict, "train_config": dict, "processes": int, "tokenizer": dict, "sha256": dict}


def read_checkpoint_info(path, verify=True):
    """checkpoint.json of a pretrain.py checkpoint directory, checked, not trusted: each field of the type written,
    the step the folder's number, the digest list naming exactly the folder's regular files (no link, nothing missing
    or extra) and (verify) each file with its SHA-256, the metadata of torch.distributed.checkpoint free of code."""
    info_path = os.path.join(path, CHECKPOINT_INFO)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such checkpoint")
    if not os.path.lexists(info_path):
        raise DataError(f"{path}: no {CHECKPOINT_INFO}: an interrupted save, or not a pretrain.py checkpoint "
                        f"directory")
    if not stat.S_ISREG(os.lstat(info_path).st_mode):  # a link (perhaps to another folder's), a FIFO
        raise DataError(f"{info_path}: damaged (not a regular file)")
    info = read_json(info_path)  # (not UTF-8, not JSON, a key given twice: refused, named)
    if problem := _info_problem(path, info):
        raise DataError(f"{info_path}: damaged or not pretrain.py's ({problem})")
    check_digests(path, info["sha256"], verify)
    if verify:
        read_metadata(path)
    return info


def check_digests(folder, digests, verify=True):
    """Each file of a digest list ({name: SHA-256}, checkpoint.json's or finetune.json's) a regular file of `folder`
    (no link, no FIFO: never opened) and (verify) of the digest saved with it."""
    for file, digest in sorted((os.path.join(folder, name), digest) for name, digest in digests.items()):
        try:
            regular = stat.S_ISREG(os.lstat(file).st_mode)
            found = sha256(file) if verify and regular else digest
        except (OSError, ValueError) as e:  # (ValueError: a name with a NUL byte or a lone surrogate)
            raise DataError(f"{file}: missing or unreadable ({getattr(e, 'strerror', None) or e})") from None
        if not regular:
            raise DataError(f"{file}: damaged (not a regular file)")
        if found != digest:
            raise DataError(f"{file}: damaged (its SHA-256 is not the one saved with it)")


def _info_problem(path, info):
    """What is wrong with checkpoint.json's `info` for the directory `path`, or None."""
    if not isinstance(info, dict):
        return "not a JSON object"
    if wrong := [k for k, kind in _INFO_TYPES.items() if type(info.get(k)) is not kind]:  # (True is no step)
        return f"{wrong[0]}: {info.get(wrong[0])!r} is not of type {_INFO_TYPES[wrong[0]].__name__}"
    number = CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    if number and info["step"] != int(number[1]):
        return f"step {info['step']} in the folder of step {int(number[1])}"
    if problem := typed_fields(ModelConfig, info["config"]):
        return f"config: {problem}"
    if not all(type(info["tokenizer"].get(k)) is str for k in ("path", "sha256")) or \
            not info["tokenizer"]["path"].endswith(".model"):
        return "tokenizer: no path of a .model file and sha256 strings"
    if not all(type(v) is str for v in info["sha256"].values()) or ".metadata" not in info["sha256"]:
        return "its digest list: no .metadata, or a digest that is no string"
    if extra := sorted({n for n in os.listdir(path) if n != CHECKPOINT_INFO} - info["sha256"].keys()):
        return f"{extra[0]!r} is in the folder but not in its digest list"  # (repr: a name may hold a line break)
    if odd := [n for n in info["sha256"] if n in ("", ".", "..", CHECKPOINT_INFO) or os.path.basename(n) != n
               or not n.isprintable()]:
        return f"its digest list names {odd[0]!r}, not a file of the folder"  # ('../x', '/dev/zero', 'a\nb')
    return None


def typed_fields(cls, values):
    """What keeps the dict `values` from being exactly the fields of the dataclass `cls`, each of its type (JSON's
    integer is a float too), or None."""
    if not isinstance(values, dict) or sorted(values) != sorted(f.name for f in fields(cls)):
        return f"not the fields of {cls.__name__}"
    for f in fields(cls):
        value = values[f.name]
        kind = typing.get_origin(f.type) or f.type  # (list[str]: a list)
        if not (type(value) is kind or kind is float and type(value) is int):
            return f"{f.name}: {value!r} is not of type {kind.__name__}"
    return None


class _MetadataUnpickler(pickle._Unpickler):  # (Python's own unpickler: its BUILD can be checked)
    """torch.distributed.checkpoint keeps its metadata as a pickle, which pickle.load would let name any function to
    call: this admits what the library's own metadata holds, builds instances of its metadata classes alone."""
    ALLOWED = {"torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                                         "ChunkStorageMetadata", "BytesStorageMetadata",
                                                         "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
               "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"},
               "torch": {"Size"}, "pathlib": {"PosixPath"}}

    def find_class(self, module, name):
        module = "pathlib" if module == "pathlib._local" else module  # (pathlib's module as Python 3.13 names it)
        if name in self.ALLOWED.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, 0),
                                                                                  torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")

    def load_build(self):  # (state set on an instance of a metadata class, never on a class or an enum's member)
        built = self.stack[-2]
        if isinstance(built, enum.Enum) or not type(built).__module__.startswith("torch.distributed.checkpoint."):
            raise pickle.UnpicklingError(f"it sets state on {built!r}, which a checkpoint's metadata never does")
        super().load_build()
    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


def read_metadata(path):
    """The checkpoint's torch.distributed.checkpoint Metadata, read without running anything: its tensors, each
    covered exactly once by its chunks, each chunk's bytes inside one of the folder's own files."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
    where = os.path.join(path, ".metadata")
    try:
        with open(where, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # (whatever a damaged or crafted pickle raises)
        raise DataError(f"{where}: refused, not a checkpoint's metadata ({type(e).__name__}: {e})") from None
    items = getattr(metadata, "state_dict_metadata", None)
    if not (isinstance(metadata, Metadata) and isinstance(items, dict) and isinstance(metadata.storage_data, dict)):
        raise DataError(f"{where}: refused, not a checkpoint's metadata")
    # The checkpoint library reads any item that is no tensor with torch.load(weights_only=False): none is read.
    metadata.state_dict_metadata = {k: v for k, v in items.items() if isinstance(v, TensorStorageMetadata)}
    sizes = {name: os.lstat(os.path.join(path, name)).st_size for name in os.listdir(path)}
    paths = [getattr(s, "relative_path", None) for s in metadata.storage_data.values()]
    if not all(isinstance(p, str) and p in sizes for p in paths):  # (a crafted list would not even hash)
        raise DataError(f"{where}: refused: it points outside the checkpoint's folder")
    if any(getattr(s, "transform_descriptors", None) for s in metadata.storage_data.values()):
        raise DataError(f"{where}: refused: its items are compressed or transformed, as pretrain.py never writes")
    unread = sum(sizes.values())  # (the tensors' bytes, together, are in the folder's files: no two share them)
    for name, item in metadata.state_dict_metadata.items():
        try:  # every element in one chunk, each chunk's bytes in its file
            boxes = [list(zip(c.offsets, c.sizes, item.size, strict=True)) for c in item.chunks]
            stored = [metadata.storage_data[MetadataIndex(name, c.offsets)] for c in item.chunks]
            numel = math.prod(item.size)
            unread -= numel * item.properties.dtype.itemsize
            # What is cheap first: chunks inside the tensor that add up to it, the tensors so far together no larger
            # than the folder's bytes. That bounds the grid of the chunks' edges below, its cells and the counting.
            exact = all(0 <= a and 0 <= n and a + n <= d for box in boxes for a, n, d in box) \
                and sum(math.prod(n for _, n, _ in box) for box in boxes) == numel \
                and unread >= 0 \
                and all(0 <= s.offset and 0 <= s.length <= sizes[s.relative_path] - s.offset for s in stored)
            if exact:  # then no two chunks overlap: each cell of the grid is in one
                edges = [sorted({0, d, *(b[i][0] for b in boxes), *(sum(b[i][:2]) for b in boxes)})
                         for i, d in enumerate(item.size)]
                counts = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int64)
                for box in boxes:  # (its cells found by bisection: a crafted file may hold 10^5 chunks)
                    cells = [slice(bisect_left(e, a), bisect_left(e, a + n)) for e, (a, n, _) in zip(edges, box)]
                    counts[tuple(cells)] += 1
                exact = bool((counts == 1).all())
        except (TypeError, ValueError, KeyError, AttributeError, RuntimeError):  # (what a crafted chunk may raise)
            exact = False
        if not exact:
            raise DataError(f"{where}: refused: its chunks do not cover {name} exactly once, each inside its file")
    return metadata


class CheckpointReader(dcp.FileSystemReader):
    """torch.distributed.checkpoint's reader of a checkpoint folder, its metadata read by `read_metadata`."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def shards(state, path, runtime=None, save=False):
    """Read `state` in place from a checkpoint folder's torch.distributed.checkpoint shards, or (save) write them, on
    `runtime`'s processes (None: this one alone). Sharded, each process reads and writes its own; replicated, each
    reads all, and the main process (the only one to call) writes all."""
    collective = runtime is not None and runtime.fsdp and torch.distributed.is_initialized()
    planner = None if runtime is None else runtime.planner(not save)
    with warnings.catch_warnings():  # (that one process works alone, which DCP warns of, is what is meant)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        try:
            if save:
                dcp.save(state, checkpoint_id=path, planner=planner, no_dist=not collective)
            else:
                dcp.load(state, storage_reader=CheckpointReader(path), planner=planner, no_dist=not collective)
        except dcp.CheckpointException as e:  # a Ctrl-C that the library wrapped as a failure is a Ctrl-C still
            raise next((f for f, _ in e.failures.values() if isinstance(f, KeyboardInterrupt)), e) from None


def from_checkpoint(path, cls=MaskedLM):
    """The `cls` (MaskedLM, or its Encoder) of a pretrain.py checkpoint directory (torch.distributed.checkpoint's
    shards, read by one process however many wrote them), every file checked first."""
    info = read_checkpoint_info(path)
    try:
        held = read_metadata(path).state_dict_metadata  # (its "model." items: the weights)
        shapes = {k.removeprefix("model."): tuple(v.size) for k, v in held.items() if k.startswith("model.")}
        model = MaskedLM(_fitting(path, ModelConfig(**info["config"]), shapes))
        shards({"model": model.state_dict()}, path)
    except DataError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # (a BaseException: whatever the shards do not fit)
        raise DataError(f"{path}: the weights do not fit the saved config: {one_line(e)}") from None
    check_finite(path, model.state_dict())
    return model if cls is MaskedLM else model.encoder


def _fitting(path, config, shapes):
    """`config` if its MaskedLM has exactly the weights of `shapes` ({name: shape}, the shards'), found before the model
    is built: a crafted config would take the memory of whatever sizes it names. Its layers first: a model of a
    million would take an hour to build even on the meta device, which allocates nothing, where the rest is checked."""
    wrong = f"{path}: the weights do not fit the saved config"
    for layers, n, what in ((r"encoder\.layers", config.num_layers, "layers"),
                            ("pretraining_layers", config.pretraining_only_layers, "pre-training-only layers")):
        if (held := {int(m[1]) for k in shapes if (m := re.match(rf"{layers}\.(\d+)\.", k))}) != set(range(n)):
            raise DataError(f"{wrong}: it names {n} {what}, the shards hold {len(held)}")
    with torch.device("meta"):
        named = {name: tuple(t.shape) for name, t in MaskedLM(config).state_dict().items()}
    if name := min((k for k in named.keys() | shapes.keys() if named.get(k) != shapes.get(k)), default=None):
        raise DataError(f"{wrong}: {name} is {named.get(name, 'none')} in it, {shapes.get(name, 'none')} in the shards")
    return config


# A run's --out-dir, pre-training's and fine-tuning's alike

TRAIN_STATE = "train_state.safetensors"  # in a state: every process's loader and random state


class RunFolder:
    """A run's --out-dir (docs/scaling.md, "Checkpoints"), locked while the run writes there. A training state is a
    ckpt-STEP folder (DCP's shards of the weights and AdamW's state by parameter name, which any number of processes
    reshards; every process's loader and random state; checkpoint.json last, with every file's SHA-256): pretrain.py's
    in the folder, finetune.py's in a part of it per rate and seed (lr-R/seed-N), beside the part's record when done.
    Only the run's own files are touched: ckpt- and 8 digits (not an export named ckpt-00000010-hf, say)."""

    def __init__(self, path, runtime, log, resume, train_config, holds, settings=None):
        """Opened by the main process. `train_config`: the dataclass of the states' train_config; `holds`: what a
        run leaves there ("checkpoints" or "fine-tuning runs"); `settings`: what makes a run this run (fine-tuning's,
        recorded in SETTINGS at the start, compared on resume; pre-training's are in each checkpoint)."""
        self.path, self.runtime, self.log, self.resume, self.holds = path, runtime, log, resume, holds
        self.train_config, self.lock, self.newest_states = train_config, None, {}
        runtime.on_main(lambda: self._open(settings))

    SETTINGS = "finetune-config.json"
    PARTS = os.path.join("lr-*", "seed-*")  # fine-tuning's runs, one per learning rate and seed

    def _open(self, settings):
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise DataError(f"--out-dir {self.path} is a file, not a folder; choose another --out-dir")
        self.lock = claim(self.path)
        here = glob.escape(self.path)  # (a "[", "*" or "?" in a folder's name is a character, not a pattern)
        parts = [self.path, *glob.glob(os.path.join(here, self.PARTS))]
        if old := [p for p in parts if os.path.lexists(os.path.join(p, "train-state.pt"))]:
            raise DataError(f"{os.path.join(old[0], 'train-state.pt')}: a training state of an older finetune.py, "
                            f"which this one does not read; remove it to train that run afresh")
        partial = [p for part in parts for p in glob.glob(os.path.join(glob.escape(part), STATES))
                   if os.path.isdir(p) and not os.path.lexists(os.path.join(p, CHECKPOINT_INFO))]
        for path in partial + glob.glob(os.path.join(here, self.PARTS, "*.tmp")):  # (never read: skipped)
            remove(path)
            self.log(f"removed {path}, left by an interrupted save")
        held = any(checkpoint_paths(p) for p in parts) or settings is not None and any(
            glob.glob(os.path.join(here, name)) for name in (os.path.join(self.PARTS, "*.json"), "results.json"))
        record = os.path.join(self.path, self.SETTINGS)
        if not held:
            if self.resume:
                self.log(f"--resume: no {self.holds.removesuffix('s')} in {self.path} yet; starting at step 0")
            if settings is not None:
                write_json(record, settings)
            return
        theirs = read_json(record) if settings is not None and os.path.exists(record) else None
        if theirs is not None and not (isinstance(theirs, dict) and isinstance(theirs.get("sha256", {}), dict)):
            raise DataError(f"{record}: damaged (not a JSON object, or its sha256 not one); choose another --out-dir")
        if theirs and theirs.get("task") != settings["task"]:  # (--resume would not make them this task's)
            raise DataError(f"{self.path} holds fine-tuning runs of {theirs.get('task')}, not {settings['task']}; "
                            f"choose another --out-dir")
        if not self.resume:
            raise DataError(f"{self.path} already holds {self.holds}; pass --resume to continue, "
                            f"or choose another --out-dir")
        if settings is None:
            return
        if theirs is None:
            raise DataError(f"{self.path} holds runs but no {self.SETTINGS} (not written by finetune.py, or "
                            f"damaged); choose another --out-dir")
        differ = differences(theirs, {k: v for k, v in settings.items() if k != "sha256"}, flags=True)
        saved = theirs.get("sha256") or {}
        differ = differ or [f"{f}: changed since then" if "sha256" in theirs else f"{f}: no SHA-256 recorded then"
                            for f, digest in settings["sha256"].items() if saved.get(f) != digest]
        if differ:
            raise DataError(f"{self.path} holds runs made with other settings ({'; '.join(differ)}); "
                            f"resume with the same ones, or choose another --out-dir")

    def part(self, lr, seed):  # fine-tuning's folder of one run (the exact rate: 1e-3 is lr-0.001)
        return os.path.join(f"lr-{lr!r}", f"seed-{seed}")

    def finished(self, part):
        """What a finished part of the run recorded, or None."""
        path = os.path.join(self.path, part, "scores.json")
        return read_json(path) if os.path.exists(path) else None

    def record(self, part, obj):
        """Record a part of the run as finished (the main process), its states then no longer needed."""
        if self.runtime.is_main:
            write_json(os.path.join(self.path, part, "scores.json"), obj)
            for state in checkpoint_paths(os.path.join(self.path, part)):
                remove(state)

    def newest(self, part=""):
        """(path, checkpoint.json) of the newest intact state (with --resume), the newer ones set aside; or None."""
        if part not in self.newest_states:
            self.newest_states[part] = self.runtime.on_main(lambda: self._newest(os.path.join(self.path, part)))
        return self.newest_states[part]

    def _newest(self, folder):
        if not self.resume or not checkpoint_paths(folder):
            return None
        damaged = []
        for path in reversed(checkpoint_paths(folder)):
            try:
                info = read_checkpoint_info(path)
                if problem := typed_fields(self.train_config, info["train_config"]):
                    raise DataError(f"{path}/{CHECKPOINT_INFO}: damaged (train_config: {problem})")
                break
            except DataError as e:
                self.log(f"warning: {e}; trying the checkpoint before it")
                damaged.append(os.path.basename(path))
        else:
            raise DataError(f"{folder}: no intact checkpoint to resume from (damaged: {', '.join(damaged)})")
        for passed in (p for p in checkpoint_paths(folder) if p > path):  # out of --keep's and --resume's way
            target, n = passed + ".damaged", 1  # kept under the first free name of .damaged, .damaged-2, ...
            while os.path.lexists(target):
                n += 1
                target = f"{passed}.damaged-{n}"
            try:
                os.replace(passed, target)
            except OSError as e:
                raise OSError(f"{passed}: cannot set it aside as {target} ({e.strerror}); move it yourself") from None
            self.log(f"moved {passed}, passed over above, to {target}")
        return path, info

    def restore(self, model, optimizer, same, steps, seed, loader=None, part=""):
        """The step of the newest intact state, its weights, AdamW's state (resharded onto this run's processes), the
        loader's place and (with as many processes) every process's random state restored; 0 without one. A state
        of another model or training (`same`: what must equal its configs; its tokenizer was checked where it was
        looked up), or past `steps` (the step count and its flag), is refused by name."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        if not (newest := self.newest(part)):
            return 0
        path, info = newest
        if differ := differences({**info["config"], **info["train_config"]}, same):
            raise DataError(f"{path} was written for another model or training ({'; '.join(differ)}); pass "
                            f"the same --config, overrides and training flags, or another --out-dir")
        if info["step"] > steps[0]:
            raise DataError(f"{path} is at step {info['step']}, past {steps[1]}")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        self.runtime.lay_out(optimizer)  # AdamW's moments, just made (SPMD: as their parameters)
        try:
            extra = read_train_state(os.path.join(path, TRAIN_STATE))
            if loader is not None:  # the loader's place first: a refusal costs nothing
                try:
                    loader.load_state_dict(extra["loader"], info["step"])
                except DataError as e:  # (the loader's words name no file)
                    raise DataError(f"{os.path.join(path, TRAIN_STATE)}: {e}") from None
            state = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
            shards(state, path, self.runtime)
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict={**optimizer_state, "state": state["optimizer"]["state"]})
            # A state renamed and rewritten as another step's (AdamW counts its steps in its own float precision):
            if wrong := [s["step"] for s in optimizer.state.values() if s["step"] != torch.tensor(info["step"]).to(
                    s["step"].dtype)]:
                raise DataError(f"{path}: damaged: AdamW's state has taken {wrong[0].item():.0f} steps, its "
                                f"{CHECKPOINT_INFO} says {info['step']}")
            if len(extra["rng"]) != info["processes"]:
                raise DataError(f"{path}: damaged: it holds the random states of {len(extra['rng'])} processes, its "
                                f"{CHECKPOINT_INFO} says {info['processes']}")
            if len(extra["rng"]) == self.runtime.world_size:
                self.runtime.set_rng_state(extra["rng"][self.runtime.rank])
            else:
                self.log(f"note: {path} was written by {len(extra['rng'])} process(es); dropout draws anew in these")
                torch.manual_seed(seed + 1 + self.runtime.rank + info["step"] * self.runtime.world_size)
        except DataError:
            raise
        except (Exception, dcp.CheckpointException) as e:  # (a BaseException): what the directory does not hold
            raise DataError(f"{path}: not a training state of this model ({one_line(e)})") from None
        self.log(f"resumed from {path} at step {info['step']}")
        return info["step"]

    def save(self, step, model, optimizer, config, train_config, tokenizer, loader=None, keep=1, part=""):
        """ckpt-STEP/, as the class describes it (checkpoint.json also holds both configs, the step and the tokenizer;
        docs/scaling.md). Then the oldest beyond `keep` go."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        runtime, folder = self.runtime, os.path.join(self.path, part)
        path = os.path.join(folder, f"ckpt-{step:08d}")
        if runtime.on_main(lambda: os.path.lexists(path)):  # (resuming set every later checkpoint aside)
            raise DataError(f"{path} exists already: not written over; move it away, or choose another --out-dir")
        model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(
            cpu_offload=not runtime.fsdp))  # replicated: what the main process writes, on the CPU
        train_state = {"rng": runtime.gather_object(runtime.rng_state())}
        if loader is not None:
            train_state["loader"] = runtime.gather_object(loader.state_dict())
        state = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}  # (AdamW: its state alone)

        def write_shards():
            try:
                shards(state, path, runtime, save=True)
            except (OSError, RuntimeError, dcp.CheckpointException) as e:  # (DCP's is a BaseException)
                raise save_error(path, e) from None
        write_shards() if runtime.fsdp else runtime.on_main(write_shards)  # (sharded, DCP tells every process)

        def complete():
            try:
                write_train_state(train_state, os.path.join(path, TRAIN_STATE))
                write_json(os.path.join(path, CHECKPOINT_INFO), {
                    "step": step, "config": asdict(config), "train_config": train_config,
                    "processes": runtime.world_size,
                    "tokenizer": {"path": os.path.abspath(tokenizer.model_file), "sha256": tokenizer.sha256},
                    "sha256": {name: sha256(os.path.join(path, name)) for name in sorted(os.listdir(path))}})
            except Exception as e:  # (safetensors' own errors name no file)
                raise save_error(path, e) from None
            for old in checkpoint_paths(folder)[:-keep]:  # (the new one is saved, whatever happens here)
                try:
                    remove(old)
                except OSError as e:
                    self.log(f"warning: {old}: not removed ({e.strerror}); it is kept beyond the count")
        runtime.on_main(complete)
        return path

    def last_good(self):
        good = checkpoint_paths(self.path)
        return f"last good checkpoint: {good[-1]}" if good else "no checkpoint was saved"


def differences(saved, now, flags=False):
    """'KEY SAVED then, NOW now' for each key of `now` whose value `saved` does not hold (flags: named --key)."""
    return [f"{'--' * flags}{k.replace('_', '-') if flags else k} {saved.get(k)!r} then, {v!r} now"
            for k, v in now.items() if saved.get(k) != v]


def claim(out_dir):
    """Lock out_dir/.lock while this run (its main process) writes there: a second run started on it meanwhile would
    delete this one's checkpoints, so that one stops at once instead. A POSIX lock: the process's own (its forked
    workers do not hold it), held while the returned file is open, gone when the process ends however it ends."""
    import fcntl  # (POSIX only, as is this lock)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, ".lock")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):  # (a FIFO would hang the open)
        raise DataError(f"{path}: not a regular file; remove it")
    lock = open(path, "a")
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # (held elsewhere: EAGAIN or EACCES, by the system)
        lock.close()
        raise DataError(f"{out_dir} is in use by another run: wait for it, or choose another --out-dir") from None
    except OSError as e:  # a file system without locks
        warnings.warn(f"{out_dir}: cannot lock it against a second run writing there at once ({e})")
    return lock


def checkpoint_paths(out_dir):
    """Complete checkpoints, oldest first: ckpt-STEP directories with their checkpoint.json."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(glob.escape(out_dir), STATES, CHECKPOINT_INFO)))


def remove(path):
    """A checkpoint folder, or the link to it (a folder moved to another disk): what was written elsewhere stays."""
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def one_line(error):
    """What failed, in one line: the checkpoint library wraps each process's error, traceback included, in its own."""
    while isinstance(error, dcp.CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # (its failures: rank -> (exception, traceback))
    cause = error
    while cause is not None and getattr(cause, "errno", None) != errno.ENOSPC:
        cause = cause.__cause__ or cause.__context__  # (torch's writer says "unexpected pos" for a full disk)
    if cause is not None:
        return f"no space left on device: {cause}"
    if isinstance(error, OSError):
        return str(error)
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def save_error(path, error):
    return OSError(f"{path}: saving failed ({one_line(error)}); the checkpoints saved before are intact")


def write_train_state(state, path):
    """Nested dicts and lists of tensors and JSON values (the loader's and the random state of every process) as
    one safetensors file, the tensors by number and the rest as JSON in its header: read back, it runs nothing."""
    from safetensors.torch import save
    tensors = {}

    def skeleton(x):
        if torch.is_tensor(x):
            tensors[str(len(tensors))] = x.detach().cpu().contiguous()
            return {"tensor": str(len(tensors) - 1)}
        if isinstance(x, dict):
            return {"dict": {k: skeleton(v) for k, v in x.items()}}
        return [skeleton(v) for v in x] if isinstance(x, (list, tuple)) else x
    metadata = {"state": json.dumps(skeleton(state))}
    write_file(path, lambda f: f.write(save(tensors, metadata=metadata)), "wb")


def read_train_state(path):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        tensors, skeleton = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["state"])

    def filled(x):
        if isinstance(x, dict):
            return tensors[x["tensor"]] if "tensor" in x else {k: filled(v) for k, v in x["dict"].items()}
        return [filled(v) for v in x] if isinstance(x, list) else x
    return filled(skeleton)


# The Hugging Face layout (transformers' RemBERT), both ways. Our names -> theirs, per module:

_HF_ENCODER = {"embeddings.norm": "embeddings.LayerNorm", "embedding_projection": "encoder.embedding_hidden_mapping_in",
               "pooler": "pooler.dense"}  # the embedding tables have the same names
_HF_LAYER = {"attention.query": "attention.self.query", "attention.key": "attention.self.key",
             "attention.value": "attention.self.value", "attention.out": "attention.output.dense",
             "attention_norm": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
             "output": "output.dense", "output_norm": "output.LayerNorm"}
_HF_HEAD = {"head.dense": "cls.predictions.dense", "head.norm": "cls.predictions.LayerNorm",
            "head.decoder": "cls.predictions.decoder"}  # (a task model's head keeps its names)
_HF_CONFIG = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
              "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
              "input_embedding_size": "input_embedding_size", "output_embedding_size": "output_embedding_size",
              "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
              "layer_norm_eps": "layer_norm_eps", "dropout": "hidden_dropout_prob"}
_HF_ARCHITECTURES = {MaskedLM: "RemBertForMaskedLM", Encoder: "RemBertModel",  # (a subclass before its base)
                     TokenClassifier: "RemBertForTokenClassification",
                     SequenceClassifier: "RemBertForSequenceClassification",
                     SpanExtractor: "RemBertForQuestionAnswering"}
# Where a directory keeps its weights, in the order from_pretrained looks (an index names the shards of one).
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def hf_name(name, table=_HF_ENCODER):
    """transformers' name of one of our parameters ("layers.3.attention.query.weight" ->
    "encoder.layer.3.attention.self.query.weight"), without the "rembert." of the task models."""
    module, parameter = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, i, rest = module.split(".", 2)
        return f"encoder.layer.{i}.{_HF_LAYER[rest]}.{parameter}"
    return f"{table.get(module, module)}.{parameter}"


def from_hf(path, cls=MaskedLM):
    """The `cls` (MaskedLM or Encoder) of a Hugging Face RemBERT directory as `save_pretrained` writes it (e.g.
    google/rembert, weights in one file), each weight checked: there, of the shape, finite. A pooler (RemBertForMaskedLM
    saves none) or MLM head (the released checkpoint has none) that is not there keeps its initialisation."""
    config, state = _read_hf(path)
    # config.json against the weights before the model is built, which takes the memory of whatever sizes it names:
    # its layers first (a model of a million would take an hour to build even on the meta device), then every
    # weight's name and shape on a model of the meta device, which allocates nothing.
    if (held := {int(m[1]) for k in state if (m := re.match(r"encoder\.layer\.(\d+)\.", k))}) != set(
            range(config.num_layers)):
        raise DataError(f"{path}: config.json says {config.num_layers} layers, but its weights hold {len(held)}")
    with torch.device("meta"):
        model = cls(config)
    encoder, prefix = (model, "") if cls is Encoder else (model.encoder, "encoder.")
    names = {prefix + name: hf_name(name) for name in encoder.state_dict()}
    if unused := sorted(k for k in state if k.startswith("encoder.layer.") and k not in names.values()):
        raise DataError(f"{path}: {unused[0]} is no weight of a RemBERT layer")
    if "pooler.dense.weight" not in state:  # as transformers does: the pooler keeps its initialisation
        names = {ours: theirs for ours, theirs in names.items() if not theirs.startswith("pooler.")}
        if cls is Encoder:  # (the MLM uses no pooler)
            warnings.warn(f"{path} has no pooler: it keeps its fresh initialisation")
    if cls is MaskedLM:
        head = {name: hf_name(name, _HF_HEAD) for name in model.state_dict() if name.startswith("head.")}
        if config.tie_embeddings and head["head.decoder.weight"] not in state:  # transformers 4 saves it once
            del head["head.decoder.weight"]
        if any(hf in state for hf in head.values()):  # a head, then all of it (tied: into the input embedding too)
            names |= head
        else:
            warnings.warn(f"{path} has no masked-LM head (cls.predictions.*): the head is freshly initialised")
    own = model.state_dict()
    for ours, theirs in names.items():
        if theirs not in state:
            raise DataError(f"{path}: the checkpoint has no {theirs}")
        if state[theirs].shape != own[ours].shape:
            raise DataError(f"{path}: {theirs} has shape {tuple(state[theirs].shape)}, "
                            f"{ours} needs {tuple(own[ours].shape)}")
        check_finite(path, {theirs: state[theirs]})
    if config.input_embedding_size == config.hidden_size:  # (H checked: the word embeddings are E_in wide)
        # transformers always projects E_in to H, this model not when E_in == H: the same only for the identity.
        H = config.hidden_size
        weight, bias = (state.get(hf_name(f"embedding_projection.{p}"), torch.empty(0)) for p in ("weight", "bias"))
        if not (torch.equal(weight, torch.eye(H).to(weight)) and torch.equal(bias, torch.zeros(H).to(bias))):
            raise DataError(f"{path}: input_embedding_size == hidden_size, but its E_in -> H projection is not "
                            f"the identity; this implementation has no projection when E_in == H")
    model = cls(config)  # then for real
    own = model.state_dict()  # (detached: copied into in place, without autograd)
    for ours, theirs in names.items():
        own[ours].copy_(state[theirs])
    if cls is MaskedLM and config.tie_embeddings and not torch.equal(model.head.decoder.weight,
                                                                     state["embeddings.word_embeddings.weight"]):
        raise DataError(f"{path}: tie_word_embeddings, but its output embedding (cls.predictions.decoder) "
                        f"differs from its input embedding")
    return model


def _read_hf(path):
    """(ModelConfig, {name: tensor}) of a Hugging Face RemBERT directory, "rembert." cut from the names. In a model of
    finetune.py, its files are checked first with the SHA-256 that its finetune.json holds (safetensors has none)."""
    import safetensors.torch
    if os.path.lexists(record := os.path.join(path, "finetune.json")):
        saved = ("config.json", "model.safetensors", "sentencepiece.model")  # (no other name is opened)
        digests = info.get("sha256") if isinstance(info := read_json(record), dict) else None
        if not (isinstance(digests, dict) and set(saved) <= digests.keys()):
            raise DataError(f"{record}: damaged (not the digests of {', '.join(saved)})")
        check_digests(path, {name: digests[name] for name in saved})
    hf = read_json(os.path.join(path, "config.json"))  # (a key twice: refused, not the last one kept)
    try:
        hf = {"hidden_dropout_prob": 0.0, **hf}  # a missing key: transformers' default
        config = ModelConfig(**{ours: hf[theirs] for ours, theirs in _HF_CONFIG.items() if theirs in hf},
                             tie_embeddings=hf.get("tie_word_embeddings", False))
    except (KeyError, TypeError, ValueError, RecursionError) as e:  # (json.JSONDecodeError is a ValueError)
        raise DataError(f"{path}/config.json: not a RemBERT config ({type(e).__name__}: {e})") from None
    if (hf.get("model_type", "rembert") != "rembert" or hf.get("hidden_act", "gelu") not in ("gelu", "gelu_python")
            or hf.get("is_decoder")):  # another architecture, another non-linearity, causal attention
        raise DataError(f"{path}/config.json: supported are RemBERT encoders (model_type rembert, is_decoder false) "
                        f"with hidden_act 'gelu'")
    if hf.get("attention_probs_dropout_prob", 0.0) != config.dropout:
        warnings.warn(f"{path}/config.json: attention_probs_dropout_prob is not hidden_dropout_prob, used for both")
    found = next((os.path.join(path, name) for name in _HF_WEIGHTS if os.path.lexists(os.path.join(path, name))), None)
    if found is None:
        raise DataError(f"{path}: neither model.safetensors nor pytorch_model.bin")
    if found.endswith(".index.json"):  # (what lies beside it may be an earlier save's: not read instead)
        raise DataError(f"{found}: a checkpoint in shards, not read here; save it as one file (max_shard_size)")
    open_input(found).close()  # (a FIFO would block its reader, /dev/zero never end, a folder say ENODEV)
    try:
        state = safetensors.torch.load_file(found) if found.endswith(".safetensors") else load_checkpoint(found)
    except safetensors.SafetensorError as e:
        raise DataError(f"{found}: not a readable safetensors file ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise DataError(f"{found}: its weights are not a dict of named tensors")
    return config, {k.removeprefix("rembert."): v for k, v in state.items()}


def save_hf(model, path):
    """Write `model` as transformers' RemBERT (config.json, model.safetensors): a MaskedLM as RemBertForMaskedLM (its
    pre-training-only layers have no place there: refused), an Encoder as RemBertModel, a task model as RemBertFor..."""
    from safetensors.torch import save
    architecture = next((name for kind, name in _HF_ARCHITECTURES.items() if isinstance(model, kind)), None)
    if architecture is None:
        raise TypeError(f"save_hf cannot export a {type(model).__name__}")
    if isinstance(model, MaskedLM) and model.config.pretraining_only_layers:
        raise ValueError("RemBERT's Hugging Face layout has no pre-training-only layers; export model.encoder")
    encoder, prefix = (model, "") if isinstance(model, Encoder) else (model.encoder, "rembert.")
    config = encoder.config
    state = {prefix + hf_name(name): t for name, t in encoder.state_dict().items()}
    if encoder is not model:  # its head: an MLM head in transformers' names, a task model's in its own
        state |= {hf_name(name, _HF_HEAD): t for name, t in model.state_dict().items()
                  if not name.startswith("encoder.")}
    if config.input_embedding_size == config.hidden_size:  # transformers always projects: the identity
        state[prefix + hf_name("embedding_projection.weight")] = torch.eye(config.hidden_size)
        state[prefix + hf_name("embedding_projection.bias")] = torch.zeros(config.hidden_size)
    hf_config = {theirs: getattr(config, ours) for ours, theirs in _HF_CONFIG.items()}
    hf_config.update(architectures=[architecture], model_type="rembert", hidden_act="gelu",
                     pad_token_id=0, tie_word_embeddings=config.tie_embeddings,
                     attention_probs_dropout_prob=config.dropout)
    if isinstance(model, (SequenceClassifier, TokenClassifier)):
        hf_config["num_labels"] = model.classifier.out_features
    os.makedirs(path, exist_ok=True)
    write_json(os.path.join(path, "config.json"), hf_config)
    # Clones: a tied output embedding is its own tensor in the file (safetensors refuses shared memory).
    weights = save({name: t.detach().cpu().clone() for name, t in state.items()}, metadata={"format": "pt"})
    write_file(os.path.join(path, "model.safetensors"), lambda f: f.write(weights), "wb")
