"""The model folder: the one module that knows how a Hugging Face model folder is laid out.

Every stage that reads or writes a model goes through here: the plain folder fetch-model
writes, the AQLM checkpoint stitch writes and the PV-tuned checkpoint pvtune writes all hold

    config.json                     the architecture; an AQLM checkpoint's has `quantization_config`
                                    {"quant_method": "aqlm", "num_codebooks", "nbits_per_codebook",
                                    "in_group_size", "out_group_size", "linear_weights_not_to_quantize"}
    model.safetensors               the tensors (or shards named by model.safetensors.index.json)
    aqflow_model.json               aqflow's marker: where the folder came from, with what settings
    tokenizer files, generation config, ...

Tensor names are the module names of the model plus the parameter: `model.layers.3.mlp.down_proj.weight`.
In an AQLM checkpoint a quantized linear X [out, in] is stored as

    X.codes      [out/og, in/g, M]    int8 (nbits <= 8) or int16, packed as the `aqlm` package stores them
    X.codebooks  [M, K, og, g]        floating, K = 2^nbits
    X.scales     [out/og, 1, 1, 1]    floating
    X.bias       [out]                where the linear has one

with og = out_group_size (1 for every checkpoint aqflow writes) and g = in_group_size.
The decoder block of a module is the first dotted integer of its name (`block_index`).

Light on purpose: only the standard library is imported with it (common.smk imports
`block_index` to plan the DAG); torch and safetensors load on first use.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, NamedTuple

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
MARKER_FILE = "aqflow_model.json"
# sha256 of each safetensors file's header and of each tensor's bytes: a job that reads one tensor
# verifies only what it reads (`read_tensor`), not the whole shard
TENSOR_SUMS_FILE = "tensor_sha256.json"
AQLM_TENSORS = ("codes", "codebooks", "scales")

# bits per element of each safetensors dtype, and the floating ones by their torch/config name
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64}
FLOAT_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
TORCH_DTYPE_NAMES = {**FLOAT_DTYPE_NAMES, "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
                     "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

# `model.layers.3.mlp.down_proj` -> ("3", "mlp.down_proj"): the first dotted integer is the block
BLOCK_NUMBER = re.compile(r"^(?:.*?\.)?(\d+)\.(.+)$")
# weights a quantizer never replaces, when counting a full-precision folder's bits
_EMBEDDING_PARTS = ("embed_tokens", "lm_head", "embed_positions", "wte", "wpe")


class ModelFolderError(ValueError):
    """A model folder's files do not hold what they should; the message names the folder."""


class NotAqlmError(ModelFolderError):
    """The folder is not an AQLM checkpoint (no quantization_config, or another method)."""


class TensorHeader(NamedTuple):
    """What a safetensors header says of one tensor: dtype ("F16", "I8", ...) and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype] * self.numel


# --- names -------------------------------------------------------------------------------------

def split_module_name(module_name: str) -> tuple[int, str]:
    """`model.layers.3.mlp.down_proj` -> (3, "mlp.down_proj"): block index and name inside the block."""
    match = BLOCK_NUMBER.match(module_name)
    if match is None:
        raise ModelFolderError(f"module {module_name!r} has no block index (expected e.g. model.layers.3.mlp.down_proj)")
    return int(match.group(1)), match.group(2)


def block_index(module_name: str) -> int:
    """`model.layers.3.mlp.down_proj` -> 3."""
    return split_module_name(module_name)[0]


def quantized_linear_prefixes(tensor_names: Iterable[str], where: str | os.PathLike) -> list[str]:
    """Module names X, sorted, that are stored as X.codes, X.codebooks and X.scales.

    Raises ModelFolderError naming `where` if some X.codes lacks its codebooks or scales."""
    names = set(tensor_names)
    prefixes = sorted(name[: -len(".codes")] for name in names if name.endswith(".codes"))
    incomplete = {prefix: [part for part in AQLM_TENSORS if f"{prefix}.{part}" not in names] for prefix in prefixes}
    incomplete = {prefix: missing for prefix, missing in incomplete.items() if missing}
    if incomplete:
        shown = ", ".join(f"{prefix} lacks {missing}" for prefix, missing in list(incomplete.items())[:5])
        raise ModelFolderError(f"{where}: quantized linears without all of {AQLM_TENSORS}: {shown}")
    return prefixes


# --- config ------------------------------------------------------------------------------------

def read_config(model_dir: str | os.PathLike) -> dict:
    """config.json of a model folder; FileNotFoundError if there is none."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no {CONFIG_FILE}: not a model folder")
    return json.loads(path.read_text())


def write_config(folder: str | os.PathLike, config: Mapping) -> None:
    """Write config.json into `folder` (a staging folder: the caller makes the folder atomic)."""
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def quantization_config(model_dir: str | os.PathLike) -> dict | None:
    """config.json's quantization_config, or None for a plain model."""
    return read_config(model_dir).get("quantization_config")


def aqlm_quantization_config(model_dir: str | os.PathLike) -> dict:
    """quantization_config of an AQLM checkpoint; NotAqlmError for any other folder."""
    config = quantization_config(model_dir)
    if not config or config.get("quant_method") != "aqlm":
        raise NotAqlmError(f"{model_dir} is not an AQLM checkpoint (quantization_config: {config})")
    return config


def new_aqlm_quantization_config(num_codebooks: int, nbits: int, group_size: int,
                                 not_quantized: list[str]) -> dict:
    """The quantization_config aqflow writes: M codebooks of 2^nbits codewords over groups of
    `group_size` inputs of one output row; `not_quantized` lists the full-precision modules."""
    return {
        "quant_method": "aqlm",
        "in_group_size": group_size,
        "out_group_size": 1,
        "num_codebooks": num_codebooks,
        "nbits_per_codebook": nbits,
        "linear_weights_not_to_quantize": not_quantized,
    }


# --- weights -----------------------------------------------------------------------------------

def has_weights(model_dir: str | os.PathLike) -> bool:
    """Whether the folder has model.safetensors or a shard index."""
    return (Path(model_dir) / WEIGHTS_INDEX_FILE).is_file() or (Path(model_dir) / WEIGHTS_FILE).is_file()


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model folder: the shards its index names (sorted), or model.safetensors."""
    from aqflow.io.artifacts import read_json

    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        return [model_dir / shard for shard in sorted(set(read_json(index, required=False)["weight_map"].values()))]
    if not (model_dir / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{model_dir} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
    return [model_dir / WEIGHTS_FILE]


def weight_file(model_dir: str | os.PathLike, key: str) -> Path:
    """The safetensors file of `model_dir` that holds tensor `key` (KeyError if the index lacks it)."""
    from aqflow.io.artifacts import read_json

    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, required=False)["weight_map"]
        if key not in weight_map:
            raise KeyError(f"{model_dir}: no tensor {key!r} in {index.name}")
        return model_dir / weight_map[key]
    return weight_files(model_dir)[0]


def read_tensor(model_dir: str | os.PathLike, key: str) -> "torch.Tensor":
    """Tensor `key` (e.g. `model.layers.0.self_attn.q_proj.weight`) of a model folder, as stored.

    With a tensor checksum record (`TENSOR_SUMS_FILE`, itself checked against the folder's
    SHA256SUMS) only the bytes read are verified: the file's header and the tensor's bytes, and
    the tensor is built from those very bytes. Without one (an older folder) the whole file is
    checked against its recorded checksum, where there is one (a hand-made folder has none).
    Either way a mismatch is the file's "corrupt: sha256" error (ArtifactError)."""
    from aqflow.io.artifacts import decoding, read_json, verified

    path = weight_file(model_dir, key)
    record_path = Path(model_dir) / TENSOR_SUMS_FILE
    if record_path.is_file():
        entry = read_json(record_path, required=False)["files"].get(path.name)
        if entry is not None and key in entry["tensors"]:
            return _read_recorded_tensor(path, key, entry)
    from safetensors import safe_open

    path = verified(path, required=False)
    with decoding(path, "safetensors file"), safe_open(str(path), framework="pt") as handle:
        if key not in handle.keys():
            raise KeyError(f"{path}: no tensor {key!r}")
        return handle.get_tensor(key)


def _read_header(handle) -> bytes:
    """The JSON header of an open safetensors file (after its 8-byte little-endian length)."""
    size = int.from_bytes(handle.read(8), "little")
    header = handle.read(size) if size <= (1 << 30) else b""
    return header if len(header) == size else b""


def _read_recorded_tensor(path: Path, key: str, entry: Mapping) -> "torch.Tensor":
    """Tensor `key` of safetensors file `path`, its header and bytes checked against `entry`
    ({"header_sha256", "tensors": {name: sha256 of its bytes}}). On any mismatch or undecodable
    header the whole file is checked against its recorded checksum (the canonical error naming
    it); a file that passes that has a stale record, also an ArtifactError."""
    import hashlib

    import torch

    from aqflow.io.artifacts import ArtifactError, redo_hint, verified

    problem = None
    with open(path, "rb") as handle:
        header = _read_header(handle)
        if hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
            problem = "header"
        else:
            info = json.loads(header)[key]
            begin, end = info["data_offsets"]
            handle.seek(8 + len(header) + begin)
            data = bytearray(handle.read(end - begin))
            if len(data) != end - begin or hashlib.sha256(data).hexdigest() != entry["tensors"][key]:
                problem = f"tensor {key!r}"
    if problem is not None:
        verified(path, required=False)
        raise ArtifactError(f"{path}: corrupt: the sha256 of its {problem} is not the one in {TENSOR_SUMS_FILE} "
                            f"(the record is stale or was edited); " + redo_hint(path.parent))
    dtype = getattr(torch, TORCH_DTYPE_NAMES[info["dtype"]])
    if not data:
        return torch.empty(info["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(info["shape"])


def tensor_checksums(path: str | os.PathLike) -> dict:
    """{"header_sha256", "tensors": {name: sha256 of the tensor's bytes}} of a safetensors file."""
    import hashlib

    with open(path, "rb") as handle:
        header = _read_header(handle)
        if not header:
            raise ModelFolderError(f"{path}: not a safetensors file (its header cannot be read)")
        entries = {name: info for name, info in json.loads(header).items() if name != "__metadata__"}
        sums = {}
        for name, info in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            handle.seek(8 + len(header) + begin)
            sums[name] = hashlib.sha256(handle.read(end - begin)).hexdigest()
    return {"header_sha256": hashlib.sha256(header).hexdigest(), "tensors": dict(sorted(sums.items()))}


def write_tensor_checksums(folder: str | os.PathLike) -> Path:
    """Write `TENSOR_SUMS_FILE` for every safetensors file of a model folder (a staging folder:
    the caller's `atomic_dir` lists the record in SHA256SUMS, so the record is checked too)."""
    folder = Path(folder)
    record = {"files": {path.name: tensor_checksums(path) for path in weight_files(folder)}}
    target = folder / TENSOR_SUMS_FILE
    target.unlink(missing_ok=True)  # may be a hard link to a source folder's record: never write through it
    target.write_text(json.dumps(record, indent=1) + "\n")
    return target


def iter_tensors(model_dir: str | os.PathLike, skip: Iterable[str] = ()) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, tensor as stored, on the CPU) for every tensor of the folder but those in `skip`,
    file by file: only one tensor need be held at a time."""
    from safetensors import safe_open

    from aqflow.io.artifacts import decoding

    skipped = set(skip)
    for path in weight_files(model_dir):
        with decoding(path, "safetensors file"), safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name not in skipped:
                    yield name, handle.get_tensor(name)


def read_tensors(model_dir: str | os.PathLike) -> dict[str, "torch.Tensor"]:
    """Every tensor of a model folder, by name, as stored, on the CPU."""
    return dict(iter_tensors(model_dir))


def tensor_headers(model_dir: str | os.PathLike) -> dict[str, TensorHeader]:
    """{name: TensorHeader(dtype, shape)} of every tensor of the folder, from the headers only."""
    from safetensors import safe_open

    from aqflow.io.artifacts import decoding

    headers = {}
    for path in weight_files(model_dir):
        with decoding(path, "safetensors file"), safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                headers[name] = TensorHeader(view.get_dtype(), tuple(view.get_shape()))
    return headers


def write_weights(folder: str | os.PathLike, tensors: Mapping[str, "torch.Tensor"]) -> Path:
    """Write `tensors` as the folder's one model.safetensors (a staging folder: the caller makes
    the folder atomic). Tensors must be contiguous CPU tensors; tied ones may not share storage."""
    from safetensors.torch import save_file

    path = Path(folder) / WEIGHTS_FILE
    save_file(dict(tensors), str(path), metadata={"format": "pt"})
    return path


def copy_side_files(model_dir: str | os.PathLike, folder: str | os.PathLike) -> list[str]:
    """Copy tokenizer files, generation config and the like from `model_dir` into `folder`: every
    file but weights, config, marker, checksums and hidden ones. Returns the names copied."""
    from aqflow.io.artifacts import SUMS_FILE

    own = {WEIGHTS_FILE, WEIGHTS_INDEX_FILE, CONFIG_FILE, MARKER_FILE, SUMS_FILE, TENSOR_SUMS_FILE}
    copied = []
    for item in sorted(Path(model_dir).iterdir()):
        if item.is_file() and item.name not in own and not item.name.startswith(".") and item.suffix != ".safetensors":
            shutil.copy2(item, Path(folder) / item.name)
            copied.append(item.name)
    return copied


def read_marker(model_dir: str | os.PathLike) -> dict | None:
    """aqflow's marker of the folder, or None for a folder aqflow did not write."""
    path = Path(model_dir) / MARKER_FILE
    return json.loads(path.read_text()) if path.is_file() else None


# --- stored bits per parameter -----------------------------------------------------------------

def aqlm_bits(headers: Mapping[str, TensorHeader], where: str | os.PathLike, nbits_per_codebook: int | None) -> dict:
    """Bits of every X.codes, X.codebooks and X.scales at their stored dtype widths over the
    out * in weights they represent (out = codes.shape[0] * og, in = codes.shape[1] * g).

    Codes count at the width of their integer dtype (4-bit codes in int8 cost 8 bits), since that
    is what the format stores; the nominal figure (codes at `nbits_per_codebook`) is given beside
    it. Full-precision tensors (embeddings, head, norms, biases) are not counted.
    """
    prefixes = quantized_linear_prefixes(headers, where)
    if not prefixes:
        raise ModelFolderError(f"{where} is marked as an AQLM checkpoint but holds no '*.codes' tensors")
    totals = {part: 0 for part in AQLM_TENSORS}
    num_weights = nominal_code_bits = 0
    for prefix in prefixes:
        codes, codebooks = headers[f"{prefix}.codes"], headers[f"{prefix}.codebooks"]
        num_weights += codes.shape[0] * codebooks.shape[2] * codes.shape[1] * codebooks.shape[3]
        for part in AQLM_TENSORS:
            totals[part] += headers[f"{prefix}.{part}"].bits
        if nbits_per_codebook is not None:
            nominal_code_bits += codes.numel * nbits_per_codebook
    stored = sum(totals.values())
    nominal = None if nbits_per_codebook is None else (stored - totals["codes"] + nominal_code_bits) / num_weights
    return {
        "format": "aqlm",
        "bits_per_parameter": stored / num_weights,
        "nominal_bits_per_parameter": nominal,
        "quantized_linears": len(prefixes),
        "quantized_parameters": num_weights,
        "stored_bits": dict(totals),
    }


def full_precision_bits(headers: Mapping[str, TensorHeader], where: str | os.PathLike) -> dict:
    """Mean stored dtype width of the weights a quantizer would replace: the 2-D `.weight`
    tensors other than the embeddings and the output head (16 for an fp16 model)."""
    linears = {name: header for name, header in headers.items()
               if name.endswith(".weight") and len(header.shape) == 2
               and not any(part in name for part in _EMBEDDING_PARTS)}
    if not linears:
        raise ModelFolderError(f"{where} holds no 2-D linear weights outside the embeddings and head")
    num_weights = sum(header.numel for header in linears.values())
    return {
        "format": "full-precision",
        "bits_per_parameter": sum(header.bits for header in linears.values()) / num_weights,
        "nominal_bits_per_parameter": None,
        "quantized_linears": 0,
        "linear_parameters": num_weights,
        "dtypes": sorted({header.dtype for header in linears.values()}),
    }


def stored_bits_per_parameter(model_dir: str | os.PathLike) -> dict:
    """Bits per parameter the folder stores, from its safetensors headers (no tensor is read):
    {"format": "aqlm" | "full-precision", "bits_per_parameter", "nominal_bits_per_parameter", ...}
    (see `aqlm_bits` and `full_precision_bits`)."""
    config = quantization_config(model_dir)
    headers = tensor_headers(model_dir)
    if config is None:
        return full_precision_bits(headers, model_dir)
    if config.get("quant_method") != "aqlm":
        raise NotAqlmError(f"{model_dir}: quantization method {config.get('quant_method')!r} is not supported (only aqlm)")
    return aqlm_bits(headers, model_dir, config.get("nbits_per_codebook"))
