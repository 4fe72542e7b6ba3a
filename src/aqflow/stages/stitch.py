"""`python -m aqflow stitch`: per-layer AQLM results + the full-precision model -> one AQLM checkpoint.

Reads the model folder and one `<module name>.safetensors` per quantized linear from the layers
folder, and writes a standard AQLM Hugging Face folder (config with `quantization_config`,
safetensors weights, tokenizer) that `transformers` + `aqlm` load with `from_pretrained`. Every
artifact is checked before anything is written; on a bad input nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import load_safetensors, verify_inputs
from aqflow.checkpoint import CheckpointError, write_aqlm_checkpoint
from aqflow.models.fetch import config_dtype
from aqflow.models.folder import stored_bits_per_parameter
from aqflow.quant.quantize import QuantizerSettings
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS

STAGE = "stitch"
INPUT_ERRORS = (*EXPECTED_ERRORS, CheckpointError)


@dataclass(frozen=True)
class StitchSettings:
    num_codebooks: int = field(metadata=option("codebooks per group (as the layers were quantized)"))
    nbits: int = field(metadata=option("bits per code (codebooks of 2^nbits codewords)"))
    group_size: int = field(default=QuantizerSettings.group_size, metadata=option("input weights per group"))
    dtype: str = field(default="auto", metadata=option(
        "dtype of codebooks, scales and the full-precision tensors (auto: the model folder's)",
        choices=("auto", "float16", "bfloat16", "float32")))


@dataclass(frozen=True)
class StitchPaths:
    model_dir: Path = field(metadata=option("full-precision Hugging Face model folder"))
    layers_dir: tuple[Path, ...] = field(metadata=option(
        "folder(s) of <module name>.safetensors layer results; each layer in exactly one"))
    output_dir: Path = field(metadata=option("checkpoint folder to create (must not exist)"))
    replace_tensors: tuple[Path, ...] = field(default=(), metadata=option(
        "safetensors files of tuned full-precision tensors (block fine-tuning's block.safetensors) "
        "stored instead of the model's"))


def run(settings: StitchSettings, paths: StitchPaths) -> Path:
    """Write the AQLM checkpoint folder; its path."""
    dtype = (config_dtype(paths.model_dir) or "float16") if settings.dtype == "auto" else settings.dtype
    verify_inputs(paths.model_dir, *paths.layers_dir, *paths.replace_tensors)
    replaced = {}
    for path in paths.replace_tensors:
        replaced.update(load_safetensors(path, verify=False))  # verified above
    return write_aqlm_checkpoint(paths.model_dir, list(paths.layers_dir), paths.output_dir,
                                 num_codebooks=settings.num_codebooks, nbits=settings.nbits,
                                 group_size=settings.group_size, dtype=dtype, replaced_tensors=replaced)


def summary(output_dir: Path) -> str:
    return f"{output_dir}: AQLM checkpoint, {stored_bits_per_parameter(output_dir)['bits_per_parameter']:.3f} stored bits per quantized weight"


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
