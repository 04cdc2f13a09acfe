"""Tests of checkpoints.py: transformers' RemBERT layout both ways (what a directory holds, what is refused and
named), torch.save'd files checked before they are read. pretrain.py's checkpoint directories are tested through
pretrain.py's runs in test_pretrain.py."""

import json
import os
import struct
import warnings
from dataclasses import replace

import pytest
import torch

import checkpoints
from checkpoints import DataError, from_hf, load_checkpoint, save_hf
from model import Encoder, MaskedLM, count_parameters
from test_model import SMALL, batch, hf_config


def test_a_config_without_optional_keys_loads_as_transformers_reads_it(tmp_path):
    """transformers fills a missing key with RemBertConfig's default (dropout 0, layer_norm_eps 1e-12...);
    its "gelu_python" is the same erf GELU as "gelu"."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.RemBertModel(hf_config(SMALL)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_norm_eps", "type_vocab_size", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_python"}))
    theirs = transformers.RemBertModel.from_pretrained(tmp_path).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dropout mismatch to warn about: both are transformers' 0
        ours = from_hf(tmp_path, Encoder).eval()
    assert ours.config.dropout == theirs.config.hidden_dropout_prob == 0.0
    input_ids, token_type_ids, attention_mask = batch(SMALL)
    with torch.no_grad():
        ref = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        torch.testing.assert_close(ours(input_ids, token_type_ids, attention_mask), ref.last_hidden_state,
                                   atol=1e-5, rtol=1e-5)


def test_save_hf_round_trip_masked_lm(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = MaskedLM(SMALL).eval()
    save_hf(ours, tmp_path)
    theirs = transformers.RemBertForMaskedLM.from_pretrained(tmp_path).eval()
    input_ids, token_type_ids, attention_mask = batch(SMALL)
    with torch.no_grad():
        mine, _ = ours(input_ids, token_type_ids, attention_mask)
        ref = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    back = from_hf(tmp_path)
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        if not name.startswith("encoder.pooler."):  # RemBertForMaskedLM has no pooler
            assert torch.equal(a, b), name



def test_save_hf_exports_a_subclass_as_its_base(tmp_path):
    """A user's subclass (a MaskedLM with a method of its own, say) is still a RemBERT: exported as its base."""
    class MyMaskedLM(MaskedLM):
        pass
    torch.manual_seed(0)
    save_hf(MyMaskedLM(SMALL), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["RemBertForMaskedLM"]
    with pytest.raises(TypeError, match="save_hf cannot export a Linear"):
        save_hf(torch.nn.Linear(2, 2), tmp_path / "linear")

@pytest.mark.parametrize("header", [
    struct.pack("<Q", 2**63) + b"{}",  # a header length past the file
    struct.pack("<Q", 5) + b"{abc}",  # not JSON
    struct.pack("<Q", 2) + b"[]",  # not an object
    struct.pack("<Q", 200001) + b"[" * 100000 + b"]" * 100001,  # nested past any recursion limit
    b"\x01\x02",  # shorter than the length field
    None,  # a tensor whose offsets run past the file, whose shape overflows, of an unknown dtype
])
def test_malformed_safetensors_are_refused_by_name(tmp_path, header):
    """Files the safetensors package refuses (it is fuzzed) become one DataError naming the file."""
    save_hf(Encoder(SMALL), tmp_path)
    if header is None:
        entries = {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]},
                   "b": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}
        text = json.dumps(entries).encode()
        header = struct.pack("<Q", len(text)) + text + b"\0" * 4
    (tmp_path / "model.safetensors").write_bytes(header)
    with pytest.raises(DataError, match="model.safetensors: not a readable safetensors file"):
        from_hf(tmp_path, Encoder)


def test_a_config_nested_deeper_than_python_reads_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="config.json: JSON nested deeper than Python reads$"):
        from_hf(tmp_path, Encoder)


@pytest.mark.parametrize("damage", ["central directory compression", "local header name length", "not a zip"])
def test_damaged_checkpoints_are_refused_by_name(tmp_path, damage):
    """Whatever the damage, one DataError naming the file (pretrain.py then tries the checkpoint before it)."""
    path = tmp_path / "ckpt.pt"
    torch.save({"model": MaskedLM(SMALL).state_dict()}, path)
    raw = bytearray(path.read_bytes())
    if damage == "central directory compression":
        central = raw.rindex(b"PK\x01\x02")  # the last record's entry in the central directory
        raw[central + 10] = 0x63  # an unknown compression method
    elif damage == "local header name length":
        raw[26] = 0xFF
    else:
        raw = bytearray(b"\x80\x02 a pickle, not a zip" + bytes(100))
    path.write_bytes(raw)
    with pytest.raises(DataError, match=r"ckpt.pt: damaged"):
        load_checkpoint(path)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_weights_file_that_is_a_folder_a_device_or_a_fifo_is_refused_by_name(tmp_path, weights):
    """Never read: a FIFO would block, /dev/zero never end."""
    save_hf(MaskedLM(SMALL), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    for make in (os.mkdir, lambda path: os.symlink("/dev/zero", path), os.mkfifo):
        make(tmp_path / weights)
        with pytest.raises(DataError, match=f"/{weights}: not a regular file"):
            from_hf(tmp_path)
        (os.rmdir if (tmp_path / weights).is_dir() else os.remove)(tmp_path / weights)
    torch.save({}, tmp_path / "pytorch_model.bin")  # an older file beside a dangling link: not read instead
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "moved" / "model.safetensors")
    with pytest.raises(DataError, match="/model.safetensors: no such file"):
        from_hf(tmp_path)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickled, it would call os.system
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused_in_one_line(tmp_path):
    """A pytorch_model.bin whose pickle names a function: torch.load(weights_only=True) refuses it in six lines that
    advise loading it unsafely; here one line, and nothing runs."""
    path, marker = tmp_path / "pytorch_model.bin", tmp_path / "ran"
    torch.save({"weight": torch.zeros(2), "x": RunsCode(marker)}, path)
    with pytest.raises(DataError, match=r"^[^\n]*/pytorch_model.bin: refused: its pickle holds more than [^\n]*$"):
        load_checkpoint(path)
    assert not marker.exists()


def test_from_hf_without_head_warns_and_pytorch_bin(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.RemBertModel(hf_config(SMALL))
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    hf.config.to_json_file(tmp_path / "config.json")
    with pytest.warns(UserWarning, match="no masked-LM head"):
        model = from_hf(tmp_path)
    assert torch.equal(model.encoder.embeddings.word_embeddings.weight, hf.embeddings.word_embeddings.weight)


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(tmp_path):
    """Part of an MLM head (not none of it), layers the config does not count, or a weights file that is no
    dict of tensors: a DataError naming it, not a fresh head, a silently shorter model or a traceback."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    transformers.RemBertForMaskedLM(hf_config(SMALL)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "cls.predictions.decoder.bias"}, tmp_path / "model.safetensors")
    with pytest.raises(DataError, match="has no cls.predictions.decoder.bias"):
        from_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(DataError, match="says 2 layers, but its weights hold 3"):
        from_hf(tmp_path, Encoder)
    # A config.json naming sizes its weights do not have is refused before a model of those sizes is built: a
    # million layers would take an hour, and an embedding of 10^13 rows more memory than any machine's address space.
    for crafted, message in (({"num_hidden_layers": 10 ** 6}, "says 1000000 layers, but its weights hold 3"),
                             ({"vocab_size": 10 ** 13}, r"word_embeddings.weight has shape \(\d+, \d+\), .* needs "
                                                        r"\(10000000000000, ")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **crafted}))
        with pytest.raises(DataError, match=message):
            from_hf(tmp_path, Encoder)
    save_file({"encoder.layer.999999.output.dense.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # alone
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 6}))
    with pytest.raises(DataError, match="says 1000000 layers, but its weights hold 1"):
        from_hf(tmp_path, Encoder)
    (tmp_path / "config.json").write_text(json.dumps(config)[:-1] + ', "num_hidden_layers": 2}')  # a key twice
    with pytest.raises(DataError, match="config.json: duplicate key 'num_hidden_layers'"):
        from_hf(tmp_path, Encoder)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").unlink()
    torch.save([torch.zeros(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(DataError, match="its weights are not a dict of named tensors"):
        from_hf(tmp_path, Encoder)


def test_unfactorized_models_export_with_an_identity_projection(tmp_path):
    """E_in == H (Table 2's baselines) has no projection here; transformers always has one: the export
    writes the identity, which transformers computes with and which loads back. A learned projection
    cannot be dropped: it is refused."""
    transformers = pytest.importorskip("transformers")
    config = replace(SMALL, input_embedding_size=32)
    torch.manual_seed(0)
    ours = MaskedLM(config).eval()
    save_hf(ours, tmp_path / "ours")
    theirs = transformers.RemBertForMaskedLM.from_pretrained(tmp_path / "ours").eval()
    input_ids, token_type_ids, attention_mask = batch(config)
    with torch.no_grad():
        reference = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(ours(input_ids, token_type_ids, attention_mask)[0], reference, atol=1e-5, rtol=1e-5)
        back = from_hf(tmp_path / "ours").eval()
        torch.testing.assert_close(back(input_ids, token_type_ids, attention_mask)[0], reference, atol=1e-5, rtol=1e-5)
    transformers.RemBertModel(hf_config(config)).save_pretrained(tmp_path / "learned")  # a random projection
    with pytest.raises(DataError, match="projection is not the identity"):
        from_hf(tmp_path / "learned")


def test_a_coupled_model_exports_and_loads_back_coupled(tmp_path):
    """transformers' RemBERT never ties (its file holds both copies, and it computes the same); our loader
    reads tie_word_embeddings back, so a coupled model stays coupled, and refuses copies that differ."""
    transformers = pytest.importorskip("transformers")
    config = replace(SMALL, input_embedding_size=24, output_embedding_size=24, tie_embeddings=True)
    torch.manual_seed(0)
    ours = MaskedLM(config).eval()
    save_hf(ours, tmp_path)
    theirs = transformers.RemBertForMaskedLM.from_pretrained(tmp_path).eval()
    back = from_hf(tmp_path).eval()
    assert back.head.decoder.weight is back.encoder.embeddings.word_embeddings.weight
    assert count_parameters(back) == count_parameters(ours)
    input_ids, token_type_ids, attention_mask = batch(config)
    with torch.no_grad():
        reference = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits
        for model in (ours, back):
            torch.testing.assert_close(model(input_ids, token_type_ids, attention_mask)[0], reference,
                                       atol=1e-5, rtol=1e-5)
    # transformers 4 saves a tied matrix once, without cls.predictions.decoder.weight: it loads tied.
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "model.safetensors")
    del state["cls.predictions.decoder.weight"]
    (tmp_path / "once").mkdir()
    save_file(state, tmp_path / "once" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "once" / "config.json").write_text((tmp_path / "config.json").read_text())
    once = from_hf(tmp_path / "once").eval()
    assert once.head.decoder.weight is once.encoder.embeddings.word_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(once(input_ids, token_type_ids, attention_mask)[0], reference, atol=1e-5, rtol=1e-5)
        theirs.cls.predictions.decoder.weight.add_(1.0)  # trained apart in transformers: no longer one matrix
    theirs.save_pretrained(tmp_path / "apart")
    with pytest.raises(DataError, match="tie_word_embeddings, but its output embedding .* differs"):
        from_hf(tmp_path / "apart")


def test_a_decoder_another_activation_or_another_architecture_is_refused(tmp_path):
    save_hf(Encoder(SMALL), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # A causal mask, another non-linearity, BERT's weights under a config that fits RemBERT's defaults.
    for change in ({"is_decoder": True}, {"hidden_act": "relu"}, {"model_type": "bert"}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(DataError, match="supported are RemBERT encoders .model_type rembert, is_decoder false. "
                                            "with hidden_act 'gelu'"):
            from_hf(tmp_path, Encoder)


def test_a_checkpoint_in_shards_is_refused_not_an_earlier_file_beside_it(tmp_path):
    """from_pretrained reads a shard index before a pytorch_model.bin; an index here is refused by name, and the
    .bin that an earlier save left beside it is not loaded in its place."""
    transformers = pytest.importorskip("transformers")
    torch.save(transformers.RemBertForMaskedLM(hf_config(SMALL)).state_dict(), tmp_path / "pytorch_model.bin")
    transformers.RemBertForMaskedLM(hf_config(SMALL)).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    with pytest.raises(DataError, match="model.safetensors.index.json: a checkpoint in shards, not read here"):
        from_hf(tmp_path)


def test_one_dropout_rate_or_a_warning(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.RemBertModel(hf_config(SMALL)).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "attention_probs_dropout_prob": 0.3}))
    with pytest.warns(UserWarning, match="attention_probs_dropout_prob is not hidden_dropout_prob, used for both"):
        from_hf(tmp_path, Encoder)
    del hf["attention_probs_dropout_prob"]  # transformers reads it as 0.0, not as hidden_dropout_prob
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_dropout_prob": 0.1}))
    with pytest.warns(UserWarning, match="attention_probs_dropout_prob is not hidden_dropout_prob, used for both"):
        from_hf(tmp_path, Encoder)


def test_from_hf_names_a_tensor_of_another_shape_or_not_finite(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.RemBertForMaskedLM(hf_config(SMALL))
    with torch.no_grad():
        hf.rembert.encoder.layer[1].output.dense.weight[0, 0] = float("nan")  # damaged, or a diverged run's
    hf.save_pretrained(tmp_path)
    with pytest.raises(DataError, match=r"encoder.layer.1.output.dense.weight holds NaN or infinite values"):
        from_hf(tmp_path)
    hf.config.intermediate_size = 65  # the config now lies about the weights
    hf.config.to_json_file(tmp_path / "config.json")
    with pytest.raises(DataError, match="intermediate.dense.weight"):
        from_hf(tmp_path)


# --------------------------------------------------------------------------------------------
# The embedding variants of the paper


def test_metadata_pickled_by_python_3_13_reads_its_paths():
    """Python 3.13 pickles pathlib's classes as pathlib._local's (the checkpoint library's metadata holds a path):
    the metadata's unpickler reads them as pathlib's, on any Python."""
    import io
    import pathlib
    import pickle
    from checkpoints import _MetadataUnpickler
    data = pickle.dumps(pathlib.PosixPath("ckpt"), protocol=2).replace(b"cpathlib\n", b"cpathlib._local\n")
    assert b"pathlib._local" in data
    assert _MetadataUnpickler(io.BytesIO(data)).load() == pathlib.PosixPath("ckpt")


def test_a_failed_write_names_the_file_and_leaves_the_file_before(tmp_path, monkeypatch):
    """checkpoints.write_file, the one writer of a file: whole or not at all."""
    path = tmp_path / "scores.json"
    checkpoints.write_json(path, {"step": 1})

    def disk_full(f):
        f.write("half a file")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match=r"scores.json: saving failed \(no space left on device"):
        checkpoints.write_file(path, disk_full)

    def interrupted(f):
        f.write("half a file")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        checkpoints.write_file(path, interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.json"]  # no partial file left
    assert json.loads(path.read_text()) == {"step": 1}


# --------------------------------------------------------------------------------------------
# A checkpoint's metadata: read, never trusted


def saved_with_dcp(path):
    """A torch.distributed.checkpoint folder of a 4 x 6 matrix and a scalar, and its metadata as the library wrote it."""
    import pickle
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process, no process group)
        dcp.save({"w": torch.arange(24.0).reshape(4, 6), "step": torch.tensor(3.0)}, checkpoint_id=str(path),
                 no_dist=True)
    return pickle.loads((path / ".metadata").read_bytes())


def test_metadata_whose_chunks_do_not_cover_each_tensor_once_inside_its_file_is_refused(tmp_path):
    """A chunk missing (half of a tensor would keep its initialisation), two overlapping, or a chunk whose bytes lie
    outside its file: refused by a line naming .metadata. Chunks that tile a tensor are read."""
    import dataclasses
    import pickle
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from checkpoints import read_metadata
    saved_with_dcp(tmp_path)
    assert set(read_metadata(str(tmp_path)).state_dict_metadata) == {"w", "step"}  # as the library wrote it

    def half(rows):
        return ChunkStorageMetadata(torch.Size([rows, 0]), torch.Size([2, 6]))

    def crafted(chunks=None, **stored):
        metadata = saved_with_dcp(tmp_path)
        index = MetadataIndex("w", torch.Size([0, 0]))
        for chunk in chunks or []:  # (each chunk's bytes: the whole matrix's)
            metadata.storage_data[MetadataIndex("w", chunk.offsets)] = metadata.storage_data[index]
        metadata.state_dict_metadata["w"].chunks = chunks or metadata.state_dict_metadata["w"].chunks
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **stored)
        (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
        return str(tmp_path)
    assert read_metadata(crafted([half(0), half(2)]))  # two halves: the whole matrix once
    for case in ([half(0)], [half(0), half(1), half(2)], [half(0), half(2), half(2)]):
        with pytest.raises(DataError, match=r"/\.metadata: refused: its chunks do not cover w exactly once"):
            read_metadata(crafted(case))
    for fields in ({"offset": 10 ** 6}, {"length": 10 ** 6}, {"offset": -1}):
        with pytest.raises(DataError, match=r"/\.metadata: refused: its chunks do not cover w exactly once, each "
                                            r"inside its file"):
            read_metadata(crafted(**fields))
    metadata = saved_with_dcp(tmp_path)  # one chunk that tiles a matrix of 10^12 elements: more than the folder holds
    w = metadata.state_dict_metadata["w"]
    w.size = torch.Size([10 ** 6, 10 ** 6])
    w.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), w.size)]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DataError, match=r"/\.metadata: refused: its chunks do not cover w exactly once, each inside"):
        read_metadata(str(tmp_path))
    for path in (["__0_0.distcp"], {"a": 1}, "../outside"):  # (a list or a dict raised TypeError: unhashable)
        with pytest.raises(DataError, match=r"/\.metadata: refused: it points outside the checkpoint's folder"):
            read_metadata(crafted(relative_path=path))


def test_metadata_whose_tensors_together_hold_more_than_the_folder_is_refused(tmp_path):
    """Tensors that all read the same bytes, each no larger than the folder but together larger: a config of their
    shapes would be built, in memory, at many times the folder's size."""
    import pickle
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from checkpoints import read_metadata
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process, no process group)
        dcp.save({"w": torch.zeros(256, 256)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    for copy in ("v", "u", "t"):
        metadata.state_dict_metadata[copy] = metadata.state_dict_metadata["w"]
        metadata.storage_data[MetadataIndex(copy, torch.Size([0, 0]))] = metadata.storage_data[
            MetadataIndex("w", torch.Size([0, 0]))]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DataError, match=r"/\.metadata: refused: its chunks do not cover [tuvw] exactly once, each "
                                        r"inside its file"):
        read_metadata(str(tmp_path))


def test_metadata_that_sets_state_on_a_class_or_names_what_the_library_never_writes_is_refused(tmp_path):
    """BUILD on a class would change it for the rest of the process (here Metadata.__init__ made torch.Size): the
    unpickler builds new instances of the library's metadata classes alone, and admits what its metadata holds."""
    import collections
    import pickle
    from torch.distributed.checkpoint.metadata import Metadata
    from checkpoints import read_metadata
    init = Metadata.__dict__["__init__"]
    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
                                         b"N}X\x08\x00\x00\x00__init__ctorch\nSize\ns\x86b.")
    try:
        with pytest.raises(DataError, match=r"\.metadata: refused.* it sets state on <class 'torch.distributed"):
            read_metadata(str(tmp_path))
    finally:
        changed = Metadata.__dict__["__init__"] is not init
        Metadata.__init__ = init
    assert not changed
    (tmp_path / ".metadata").write_bytes(pickle.dumps(collections.OrderedDict()))
    with pytest.raises(DataError, match=r"it names collections.OrderedDict, which a checkpoint's metadata never"):
        read_metadata(str(tmp_path))


def test_checkpoint_json_refusals_are_one_plain_line(tmp_path):
    """A checkpoint.json that is a FIFO is named once (not inside a second "damaged" line); a field of another type
    says which type, in words."""
    import os
    from checkpoints import read_checkpoint_info, typed_fields
    from model import ModelConfig
    os.mkfifo(tmp_path / "checkpoint.json")
    with pytest.raises(DataError, match=r"^[^()]*/checkpoint.json: damaged \(not a regular file\)$"):
        read_checkpoint_info(str(tmp_path))
    assert typed_fields(ModelConfig, {**SMALL.__dict__, "num_layers": "2"}) == "num_layers: '2' is not of type int"
