"""`python -m aqflow calibrate-block`: one step of the sequential propagation mode.

Block i >= 1 is calibrated on the outputs of the quantized blocks < i. This step needs only block
i-1: its inputs (--previous-inputs, written by the step for block i-1; for i = 1 they are the
embeddings, recomputed from the windows) and its quantized layers (--previous-layers-dir holding
`<module>.safetensors` per linear of block i-1, plus the tuned norms of --previous-block-tensors
after block fine-tuning). It runs the quantized block i-1, accumulates the XᵀX of block i (full
precision) on what comes out, and writes

    --output-dir     block{i}.npz, manifest.parquet, calibration.json (as `calibrate` does)
    --inputs-output  the inputs of block i [num_windows, T, hidden] (safetensors), for block i+1

The windows are those of the shared calibration folder (--calibration-dir, from `calibrate
--propagation sequential`), so every block sees the same tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.calibration.hessians import save_block_xtx
from aqflow.models.structure import find_decoder_blocks
from aqflow.stages.calibrate import CalibrateSettings
from aqflow.calibration.sequential import (
    WINDOWS_FILE,
    block_layer_files,
    block_prefix_of,
    embedded_inputs,
    load_block_tensors,
    load_hidden_states,
    load_windows,
    save_hidden_states,
    sequential_block_xtx,
)
from aqflow.io.artifacts import verify_inputs
from aqflow.checkpoint import CheckpointError
from aqflow.models.fetch import ModelInputError, load_causal_lm, model_compute_dtype
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "calibrate-block"
INPUT_ERRORS = (*EXPECTED_ERRORS, CheckpointError, ModelInputError)


@dataclass(frozen=True)
class CalibrateBlockSettings:
    block: int = field(metadata=option("block to calibrate (>= 1)"))
    batch_size: int = field(default=CalibrateSettings.batch_size, metadata=option("windows per forward pass"))
    device: str = field(default_factory=stage_cli.default_device)
    quiet: bool = field(default=False, metadata=option("no progress bar"))


@dataclass(frozen=True)
class CalibrateBlockPaths:
    model_dir: Path = field(metadata=option("full-precision model folder"))
    calibration_dir: Path = field(metadata=option("shared calibration folder (windows.safetensors, calibration.json)"))
    previous_layers_dir: Path = field(metadata=option(
        "folder with the quantized linears of block-1 (<module>.safetensors)"))
    output_dir: Path
    inputs_output: Path = field(metadata=option("where to write the inputs of --block"))
    previous_block_tensors: Path | None = field(default=None, metadata=option(
        "tuned non-quantized parameters of block-1 (block fine-tuning's block.safetensors)"))
    previous_inputs: Path | None = field(default=None, metadata=option(
        "inputs of block-1 (from the step for block-1); not for --block 1"))


def previous_inputs(settings: CalibrateBlockSettings, paths: CalibrateBlockPaths, model,
                    windows: torch.Tensor) -> torch.Tensor:
    """Inputs of block --block - 1 in the quantized model: [num_windows, T, hidden]."""
    if settings.block == 1:
        if paths.previous_inputs is not None:
            raise StageInputError("--block 1 takes no --previous-inputs: block 0's inputs are the embeddings")
        return embedded_inputs(model, windows, settings.batch_size, progress=not settings.quiet)
    if paths.previous_inputs is None:
        raise StageInputError(f"--block {settings.block} needs --previous-inputs (the inputs of block {settings.block - 1})")
    hidden = load_hidden_states(paths.previous_inputs, windows)
    return hidden.to(device=settings.device, dtype=next(model.parameters()).dtype)


def run(settings: CalibrateBlockSettings, paths: CalibrateBlockPaths) -> dict:
    """Block `settings.block`'s calibration folder and inputs written; its calibration.json."""
    verify_inputs(paths.model_dir, paths.calibration_dir, paths.previous_layers_dir, paths.previous_block_tensors,
                  paths.previous_inputs)
    started = time.perf_counter()
    shared = json.loads((paths.calibration_dir / "calibration.json").read_text())
    if shared.get("propagation") != "sequential":
        raise StageInputError(f"{paths.calibration_dir} was calibrated with propagation {shared.get('propagation')!r}; "
                         "sequential steps need `calibrate --propagation sequential`")
    windows = load_windows(paths.calibration_dir / WINDOWS_FILE)
    model = load_causal_lm(paths.model_dir, dtype=model_compute_dtype(paths.model_dir, settings.device), device=settings.device)
    _, blocks = find_decoder_blocks(model)
    if not 1 <= settings.block < len(blocks):
        raise StageInputError(f"--block {settings.block}: the model has blocks 0..{len(blocks) - 1}; block 0 is calibrated by `calibrate`")
    previous = settings.block - 1
    prefix = block_prefix_of(model, previous)
    layer_files = block_layer_files(paths.previous_layers_dir, prefix, blocks[previous])
    missing = [str(path) for path in layer_files.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"block {previous} is not fully quantized: missing {missing}")
    tensors = load_block_tensors(paths.previous_block_tensors, prefix)
    hidden_in = previous_inputs(settings, paths, model, windows)
    stats, hidden_out = sequential_block_xtx(model, windows, settings.block, hidden_in, layer_files, tensors,
                                             batch_size=settings.batch_size, progress=not settings.quiet)
    with artifacts.atomic_dir(paths.output_dir) as staging:
        manifest = save_block_xtx(staging, {settings.block: stats}, shared["source"])
        artifacts.write_json(staging / "calibration.json", {
            "propagation": "sequential",
            "block": settings.block,
            "blocks": len(blocks),
            "blocks_calibrated": [settings.block],
            "sites": len(manifest),
            "tokens": int(manifest["tokens"].iloc[0]),
            "source": shared["source"],
            "previous_layers_dir": str(paths.previous_layers_dir),
            "previous_block_tensors": str(paths.previous_block_tensors) if paths.previous_block_tensors else None,
            "block_finetuned": paths.previous_block_tensors is not None,
            "seconds": time.perf_counter() - started,
            "device": settings.device,
        })
    save_hidden_states(paths.inputs_output, hidden_out, settings.block)
    return json.loads((paths.output_dir / "calibration.json").read_text())


def summary(record: dict) -> str:
    return (f"block {record['block']}: {record['sites']} input sites, {record['tokens']} tokens through the "
            f"quantized block {record['block'] - 1} in {record['seconds']:.1f} s")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
