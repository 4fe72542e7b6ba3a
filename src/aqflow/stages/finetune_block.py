"""`python -m aqflow finetune-block`: block fine-tuning of one quantized block (sequential mode).

Reads the block's quantized linears (--layers-dir, `<module>.safetensors` each) and its inputs in
the quantized model (--inputs, written by `calibrate-block`; for block 0 the embeddings,
recomputed from the shared calibration windows), computes the full-precision block's outputs on
those inputs as targets, and tunes codebooks, scales, norms and biases with Adam to match them
(see `aqflow.calibration.block_finetune`). Writes into --output-dir, atomically:

    <module>.safetensors   per linear: the same codes, tuned codebooks and scales (layer artifact format)
    block.safetensors      the tuned norms and biases, by full parameter name
    finetune.json          relative output error before, after every epoch, and kept; settings; seconds
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.calibration.block_finetune import BlockFinetuneSettings, QuantizedLinearParams, cast_floats, finetune_block
from aqflow.calibration.hessians import block_forward
from aqflow.models.structure import find_decoder_blocks
from aqflow.calibration.sequential import (
    WINDOWS_FILE,
    BLOCK_TENSORS_FILE,
    block_call_inputs,
    block_layer_files,
    block_prefix_of,
    embedded_inputs,
    load_hidden_states,
    load_windows,
)
from aqflow.io.artifacts import load_safetensors, verify_inputs
from aqflow.models.fetch import ModelInputError, load_causal_lm, model_compute_dtype
from aqflow.quant.representation import pack_codes, unpack_codes
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "finetune-block"
INPUT_ERRORS = (*EXPECTED_ERRORS, ModelInputError)


@dataclass(frozen=True)
class FinetuneBlockSettings:
    block: int = field(metadata=option("block to tune"))
    tuning: BlockFinetuneSettings = field(default_factory=BlockFinetuneSettings)
    device: str = field(default_factory=stage_cli.default_device)
    quiet: bool = field(default=False, metadata=option("no progress bar"))


@dataclass(frozen=True)
class FinetuneBlockPaths:
    model_dir: Path = field(metadata=option("full-precision model folder"))
    calibration_dir: Path = field(metadata=option("shared calibration folder (windows)"))
    layers_dir: Path = field(metadata=option("folder with the block's quantized linears"))
    output_dir: Path
    inputs: Path | None = field(default=None, metadata=option("the block's inputs (from calibrate-block); not for block 0"))


def read_quantized(path: Path) -> tuple[QuantizedLinearParams, int]:
    """A layer artifact as (unpacked params, nbits)."""
    tensors = load_safetensors(path)
    nbits = tensors["codebooks"].shape[1].bit_length() - 1
    return QuantizedLinearParams(unpack_codes(tensors["codes"], nbits), tensors["codebooks"], tensors["scales"]), nbits


def run(settings: FinetuneBlockSettings, paths: FinetuneBlockPaths) -> dict:
    """The tuned block folder at paths.output_dir; its finetune.json record."""
    verify_inputs(paths.model_dir, paths.calibration_dir, paths.layers_dir, paths.inputs)
    tuning = settings.tuning
    windows = load_windows(paths.calibration_dir / WINDOWS_FILE)
    # the model in its compute dtype (its own on a GPU, float32 on a CPU); only the tuned block goes to float32
    model = load_causal_lm(paths.model_dir, dtype=model_compute_dtype(paths.model_dir, settings.device), device=settings.device)
    _, blocks = find_decoder_blocks(model)
    if not 0 <= settings.block < len(blocks):
        raise StageInputError(f"--block {settings.block}: the model has blocks 0..{len(blocks) - 1}")
    if (settings.block == 0) != (paths.inputs is None):
        raise StageInputError("give --inputs for every block but block 0 (whose inputs are the embeddings)")
    block, prefix = blocks[settings.block], block_prefix_of(model, settings.block)
    files = block_layer_files(paths.layers_dir, prefix, block)
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"block {settings.block} is not fully quantized: missing {missing}")
    quantized = {name: read_quantized(path) for name, path in files.items()}
    call = cast_floats(block_call_inputs(model, windows, settings.block), torch.float32)
    if paths.inputs is None:
        hidden_in = embedded_inputs(model, windows, tuning.batch_size, progress=not settings.quiet)
    else:
        hidden_in = load_hidden_states(paths.inputs, windows).to(settings.device)
    hidden_in = hidden_in.float()
    block.float()  # targets and tuning in float32
    with torch.no_grad():  # targets: the full-precision block on the same inputs
        targets = torch.cat([block_forward(block, call, hidden_in[s:s + tuning.batch_size])
                             for s in range(0, hidden_in.shape[0], tuning.batch_size)])
    result = finetune_block(block, call, hidden_in, targets, {n: q for n, (q, _) in quantized.items()}, tuning,
                            progress=not settings.quiet)
    summary = {
        "block": settings.block,
        "relative_mse_before": result.relative_mse_before,
        "relative_mse_after": result.relative_mse_after,
        "relative_mse_per_epoch": result.relative_mse_per_epoch,
        "best_epoch": result.best_epoch,
        "seconds": result.seconds,
        "settings": dataclasses.asdict(tuning),
        "tuned_block_tensors": sorted(result.block_tensors),
        "device": settings.device,
    }
    with artifacts.atomic_dir(paths.output_dir) as staging:
        for name, params in result.linears.items():
            nbits = quantized[name][1]
            artifacts.save_safetensors(staging / files[name].name, {
                "codes": pack_codes(params.codes.cpu(), nbits),
                "codebooks": params.codebooks.cpu(),
                "scales": params.scales.cpu(),
            }, {"layer": f"{prefix}.{name}", "format": "aqlm", "block_finetuned": "true"})
        artifacts.save_safetensors(staging / BLOCK_TENSORS_FILE,
                                   {f"{prefix}.{name}": t.cpu() for name, t in result.block_tensors.items()})
        artifacts.write_json(staging / "finetune.json", summary)
    return summary


def summary(record: dict) -> str:
    return (f"block {record['block']}: relative output MSE {record['relative_mse_before']:.5f} -> "
            f"{record['relative_mse_after']:.5f} (best epoch {record['best_epoch']}, {record['seconds']:.1f} s)")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
