"""Bits per parameter a model folder actually stores, read from its safetensors headers.

AQLM checkpoint (config.json has quantization_config.quant_method == "aqlm"): every quantized
linear X is stored as X.codes [out/og, in/g, M], X.codebooks [M, K, og, g] and X.scales
[out/og, 1, 1, 1]; the count is the bits of those three tensors at their stored dtype widths
over the out * in weights they represent (out = codes.shape[0] * og, in = codes.shape[1] * g).
Nominal bits (codes at nbits_per_codebook) are reported beside it; they differ only where codes
sit in a wider integer type (e.g. 12-bit codes in int16).

Full-precision folder: the mean dtype width of the weights that a quantizer would replace: the
2-D `.weight` tensors other than the embeddings and the output head (16 for an fp16 model).
Only headers are read, never the tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64}
AQLM_TENSORS = ("codes", "codebooks", "scales")
_FULL_PRECISION_EXCLUDED = ("embed_tokens", "lm_head", "embed_positions", "wte", "wpe")


def _tensor_headers(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype, shape)} over every safetensors file of the folder."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors weights")
    headers = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                headers[name] = (tensor.get_dtype(), list(tensor.get_shape()))
    return headers


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _bits(entry: tuple[str, list[int]]) -> int:
    dtype, shape = entry
    return DTYPE_BITS[dtype] * _numel(shape)


def quantization_config(model_dir: str | os.PathLike) -> dict | None:
    """config.json's quantization_config, or None for a plain model."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("quantization_config")


def aqlm_bits(model_dir: Path, nbits_per_codebook: int | None) -> dict:
    """Stored bits of codes, codebooks and scales over the weights of the quantized linears."""
    headers = _tensor_headers(model_dir)
    prefixes = sorted(name[: -len(".codes")] for name in headers if name.endswith(".codes"))
    if not prefixes:
        raise ValueError(f"{model_dir} is marked as an AQLM checkpoint but holds no '*.codes' tensors")
    totals = {key: 0 for key in AQLM_TENSORS}
    num_weights = nominal_code_bits = 0
    for prefix in prefixes:
        missing = [key for key in AQLM_TENSORS if f"{prefix}.{key}" not in headers]
        if missing:
            raise ValueError(f"{model_dir}: quantized linear {prefix!r} lacks {missing}")
        codes_shape = headers[f"{prefix}.codes"][1]
        codebooks_shape = headers[f"{prefix}.codebooks"][1]
        num_weights += codes_shape[0] * codebooks_shape[2] * codes_shape[1] * codebooks_shape[3]
        for key in AQLM_TENSORS:
            totals[key] += _bits(headers[f"{prefix}.{key}"])
        if nbits_per_codebook is not None:
            nominal_code_bits += _numel(codes_shape) * nbits_per_codebook
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


def full_precision_bits(model_dir: Path) -> dict:
    """Mean stored dtype width of the linear weights a quantizer would replace."""
    headers = _tensor_headers(model_dir)
    linears = {name: entry for name, entry in headers.items()
               if name.endswith(".weight") and len(entry[1]) == 2
               and not any(part in name for part in _FULL_PRECISION_EXCLUDED)}
    if not linears:
        raise ValueError(f"{model_dir} holds no 2-D linear weights outside the embeddings and head")
    num_weights = sum(_numel(shape) for _, shape in linears.values())
    return {
        "format": "full-precision",
        "bits_per_parameter": sum(_bits(entry) for entry in linears.values()) / num_weights,
        "nominal_bits_per_parameter": None,
        "quantized_linears": 0,
        "linear_parameters": num_weights,
        "dtypes": sorted({dtype for dtype, _ in linears.values()}),
    }


def stored_bits_per_parameter(model_dir: str | os.PathLike) -> dict:
    """{"format", "bits_per_parameter", ...} for an AQLM checkpoint or a full-precision folder."""
    model_dir = Path(model_dir)
    config = quantization_config(model_dir)
    if config is None:
        return full_precision_bits(model_dir)
    if config.get("quant_method") != "aqlm":
        raise ValueError(f"{model_dir}: quantization method {config.get('quant_method')!r} is not supported (only aqlm)")
    return aqlm_bits(model_dir, config.get("nbits_per_codebook"))
