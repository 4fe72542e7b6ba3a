"""The model folder module: sharded and single-file weights, headers, stored bits, tensor and module names."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from aqflow.checkpoint import quantized_linear_names
from aqflow.models import folder
from aqflow.models.structure import find_decoder_blocks, find_linears, meta_model


def _llama(num_layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def test_block_index_is_the_block_the_module_tree_puts_each_linear_in(tmp_path):
    """For Llama (`model.layers.N`) and OPT (`model.decoder.layers.N`), the name-only reading of the
    block agrees with the module tree's, for every quantized linear."""
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                   num_attention_heads=4, word_embed_proj_dim=32))
    for model in (_llama(num_layers=12), opt):
        blocks_name, blocks = find_decoder_blocks(model)
        for index, block in enumerate(blocks):
            for linear in find_linears(block):
                assert folder.split_module_name(f"{blocks_name}.{index}.{linear}") == (index, linear)
        assert sorted({folder.block_index(name) for name in quantized_linear_names(model)}) == list(range(len(blocks)))
    with pytest.raises(ValueError, match="lm_head"):
        folder.block_index("lm_head")


def test_sharded_and_single_file_folders_read_the_same_tensors(tmp_path):
    model = _llama()
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert folder.weight_files(tmp_path / "single") == [tmp_path / "single" / folder.WEIGHTS_FILE]
    shards = folder.weight_files(tmp_path / "sharded")
    assert len(shards) > 2 and all(path.is_file() for path in shards)

    state = model.state_dict()
    single, sharded = folder.read_tensors(tmp_path / "single"), folder.read_tensors(tmp_path / "sharded")
    assert single.keys() == sharded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(single[name], tensor) and torch.equal(sharded[name], tensor)
        assert torch.equal(folder.read_tensor(tmp_path / "sharded", name), tensor)
    index = json.loads((tmp_path / "sharded" / folder.WEIGHTS_INDEX_FILE).read_text())["weight_map"]
    name = "model.layers.1.mlp.down_proj.weight"
    assert folder.weight_file(tmp_path / "sharded", name) == tmp_path / "sharded" / index[name]
    assert folder.tensor_headers(tmp_path / "sharded") == {
        name: folder.TensorHeader("F32", tuple(tensor.shape)) for name, tensor in state.items()}
    assert dict(folder.iter_tensors(tmp_path / "sharded", skip=[name])).keys() == state.keys() - {name}
    with pytest.raises(KeyError, match="no tensor 'model.nothing.weight'"):
        folder.read_tensor(tmp_path / "sharded", "model.nothing.weight")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        folder.weight_files(tmp_path)


def test_full_precision_bits_count_the_block_linears_at_their_dtype(tmp_path):
    model = _llama()
    model.half().save_pretrained(tmp_path / "fp16", max_shard_size="40KB")
    bits = folder.stored_bits_per_parameter(tmp_path / "fp16")
    linears = sum(module.weight.numel() for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and name != "lm_head")
    assert bits["format"] == "full-precision" and bits["bits_per_parameter"] == 16.0
    assert bits["linear_parameters"] == linears and bits["dtypes"] == ["F16"]


def _aqlm_folder(path, codes_dtype: torch.dtype, nbits: int):
    """A hand-made AQLM folder with two quantized linears (one [16, 32], one [8, 64]) and no other tensor."""
    path.mkdir()
    tensors = {}
    for name, (out_features, in_features) in {"model.layers.0.a": (16, 32), "model.layers.1.b": (8, 64)}.items():
        tensors[f"{name}.codes"] = torch.zeros(out_features, in_features // 8, 2, dtype=codes_dtype)
        tensors[f"{name}.codebooks"] = torch.zeros(2, 2**nbits, 1, 8, dtype=torch.float16)
        tensors[f"{name}.scales"] = torch.ones(out_features, 1, 1, 1, dtype=torch.float16)
    folder.write_weights(path, tensors)
    folder.write_config(path, {"model_type": "llama", "quantization_config": folder.new_aqlm_quantization_config(
        num_codebooks=2, nbits=nbits, group_size=8, not_quantized=["lm_head"])})
    return path


def test_aqlm_stored_bits_are_the_bytes_of_codes_codebooks_and_scales_on_disk(tmp_path):
    """Checked against the file itself: its size less the header is every stored byte."""
    aqlm = _aqlm_folder(tmp_path / "aqlm", torch.int16, nbits=12)
    weights = aqlm / folder.WEIGHTS_FILE
    with open(weights, "rb") as handle:
        (header_length,) = struct.unpack("<Q", handle.read(8))
    data_bits = 8 * (weights.stat().st_size - 8 - header_length)
    bits = folder.stored_bits_per_parameter(aqlm)
    assert bits["format"] == "aqlm" and bits["quantized_linears"] == 2
    assert bits["quantized_parameters"] == 16 * 32 + 8 * 64
    assert bits["bits_per_parameter"] == pytest.approx(data_bits / (16 * 32 + 8 * 64))
    # 12-bit codes sit in int16: the nominal figure counts them at 12 bits
    codes = 2 * (16 * 4 + 8 * 8)
    assert bits["nominal_bits_per_parameter"] == pytest.approx((data_bits - 4 * codes) / (16 * 32 + 8 * 64))


def test_a_quantized_linear_without_its_scales_is_refused_by_name(tmp_path):
    aqlm = _aqlm_folder(tmp_path / "aqlm", torch.int8, nbits=8)
    tensors = folder.read_tensors(aqlm)
    del tensors["model.layers.1.b.scales"]
    save_file(tensors, str(aqlm / folder.WEIGHTS_FILE))
    with pytest.raises(folder.ModelFolderError, match=r"model.layers.1.b lacks \['scales'\]"):
        folder.stored_bits_per_parameter(aqlm)
    assert folder.quantized_linear_prefixes(["x.codes", "x.codebooks", "x.scales", "y.weight"], aqlm) == ["x"]


def test_quantization_config_tells_aqlm_from_plain_and_from_other_methods(tmp_path):
    aqlm = _aqlm_folder(tmp_path / "aqlm", torch.int8, nbits=8)
    assert folder.aqlm_quantization_config(aqlm)["nbits_per_codebook"] == 8
    _llama().save_pretrained(tmp_path / "plain")
    assert folder.quantization_config(tmp_path / "plain") is None
    with pytest.raises(folder.NotAqlmError):
        folder.aqlm_quantization_config(tmp_path / "plain")
    folder.write_config(tmp_path / "plain", {**folder.read_config(tmp_path / "plain"),
                                             "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(folder.NotAqlmError, match="gptq"):
        folder.stored_bits_per_parameter(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        folder.read_config(tmp_path)


def test_side_files_are_everything_but_weights_config_marker_and_checksums(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    _llama().save_pretrained(source, max_shard_size="40KB")
    for name in ("tokenizer.json", "special_tokens_map.json", folder.MARKER_FILE, "SHA256SUMS", ".hidden"):
        (source / name).write_text("{}")
    target.mkdir()
    copied = folder.copy_side_files(source, target)
    assert copied == sorted(p.name for p in target.iterdir())
    assert set(copied) == {"generation_config.json", "special_tokens_map.json", "tokenizer.json"}
    assert folder.read_marker(source) == {} and folder.read_marker(target) is None


def test_meta_model_builds_the_module_tree_without_weights(tmp_path):
    _llama().save_pretrained(tmp_path / "plain")
    model = meta_model(tmp_path / "plain")
    assert all(parameter.device.type == "meta" for parameter in model.parameters())
    assert quantized_linear_names(model) == quantized_linear_names(_llama())


def _recorded_folder(path, model, max_shard_size="40KB"):
    """A model folder as aqflow writes it: atomic (SHA256SUMS) with its tensor checksum record."""
    from aqflow.io import artifacts

    with artifacts.atomic_dir(path) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        folder.write_tensor_checksums(staging)
    return path


def _flip(path, offset):
    from aqflow.io import artifacts

    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    artifacts._VERIFIED.clear()


def _data_offset(path, name):
    """Where tensor `name`'s bytes start in safetensors file `path`."""
    size = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return 8 + size + json.loads(path.read_bytes()[8:8 + size])[name]["data_offsets"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_read_tensor_verifies_only_the_bytes_it_reads_and_refuses_them_changed(tmp_path, monkeypatch, dtype):
    """With the tensor checksum record a tensor is read without hashing its whole shard; a changed
    byte of that tensor or of its file's header is the shard's 'corrupt: sha256' error, a changed
    byte of another tensor is refused by whoever reads that tensor, and an edited record is refused
    by the folder's SHA256SUMS."""
    from aqflow.io import artifacts

    model = _llama().to(dtype)
    state = model.state_dict()
    root = _recorded_folder(tmp_path / "m", model)
    hashed = []
    real_file_sha256 = artifacts.file_sha256
    monkeypatch.setattr(artifacts, "file_sha256", lambda path: hashed.append(str(path)) or real_file_sha256(path))
    for name, tensor in state.items():
        read = folder.read_tensor(root, name)
        assert read.dtype == dtype and torch.equal(read, tensor)
    assert hashed and not any(path.endswith(".safetensors") for path in hashed)  # only the record and the index

    name = "model.layers.1.mlp.down_proj.weight"
    shard = folder.weight_file(root, name)
    other = next(key for key in state if key != name and folder.weight_file(root, key) == shard)
    _flip(shard, _data_offset(shard, other) + 5)
    assert torch.equal(folder.read_tensor(root, name), state[name])  # its bytes are intact
    with pytest.raises(artifacts.ArtifactError, match=f"{shard}: corrupt: sha256"):
        folder.read_tensor(root, other)
    _flip(shard, _data_offset(shard, other) + 5)  # undo
    _flip(shard, _data_offset(shard, name) + 3)
    with pytest.raises(artifacts.ArtifactError, match=f"{shard}: corrupt: sha256"):
        folder.read_tensor(root, name)
    _flip(shard, _data_offset(shard, name) + 3)
    _flip(shard, 20)  # the header
    with pytest.raises(artifacts.ArtifactError, match=f"{shard}: corrupt: sha256"):
        folder.read_tensor(root, name)
    _flip(shard, 20)
    record = root / folder.TENSOR_SUMS_FILE
    text = json.loads(record.read_text())
    digest = text["files"][shard.name]["tensors"][name]
    text["files"][shard.name]["tensors"][name] = digest[::-1]
    record.write_text(json.dumps(text))
    artifacts._VERIFIED.clear()
    with pytest.raises(artifacts.ArtifactError, match=f"{record}: corrupt: sha256"):
        folder.read_tensor(root, name)


def test_a_stale_tensor_record_is_refused_and_a_folder_without_one_is_checked_whole(tmp_path):
    from aqflow.io import artifacts

    model = _llama()
    root = _recorded_folder(tmp_path / "m", model, max_shard_size="10GB")
    name = "model.layers.0.self_attn.q_proj.weight"
    # a record that disagrees with a file that matches SHA256SUMS (made by hand, or a bug): refused
    record = root / folder.TENSOR_SUMS_FILE
    text = json.loads(record.read_text())
    text["files"][folder.WEIGHTS_FILE]["tensors"][name] = "0" * 64
    record.write_text(json.dumps(text))
    artifacts.write_checksums(root)
    artifacts._VERIFIED.clear()
    with pytest.raises(artifacts.ArtifactError, match=f"corrupt: the sha256 of its tensor '{name}' is not the one in"):
        folder.read_tensor(root, name)
    # no record (a folder of an older aqflow): any changed byte of the shard is refused, as before
    record.unlink()
    artifacts.write_checksums(root)
    shard = root / folder.WEIGHTS_FILE
    _flip(shard, _data_offset(shard, "model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(artifacts.ArtifactError, match=f"{shard}: corrupt: sha256"):
        folder.read_tensor(root, name)


def test_the_record_is_no_side_file_of_a_derived_folder(tmp_path):
    root = _recorded_folder(tmp_path / "m", _llama())
    (tmp_path / "derived").mkdir()
    assert folder.TENSOR_SUMS_FILE not in folder.copy_side_files(root, tmp_path / "derived")
