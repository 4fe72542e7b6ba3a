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

import argparse
import json
import time
from pathlib import Path

import torch

from aqflow import artifacts
from aqflow.calibration.hessians import save_block_xtx
from aqflow.models.structure import find_decoder_blocks
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
from aqflow.models.fetch import load_causal_lm, model_compute_dtype
from aqflow.artifacts import verify_inputs
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow calibrate-block", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path, help="full-precision model folder")
    parser.add_argument("--calibration-dir", required=True, type=Path,
                        help="shared calibration folder (windows.safetensors, calibration.json)")
    parser.add_argument("--block", required=True, type=int, help="block to calibrate (>= 1)")
    parser.add_argument("--previous-layers-dir", required=True, type=Path,
                        help="folder with the quantized linears of block-1 (<module>.safetensors)")
    parser.add_argument("--previous-block-tensors", type=Path, default=None,
                        help="tuned non-quantized parameters of block-1 (block fine-tuning's block.safetensors)")
    parser.add_argument("--previous-inputs", type=Path, default=None,
                        help="inputs of block-1 (from the step for block-1); not for --block 1")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--inputs-output", required=True, type=Path, help="where to write the inputs of --block")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quiet", action="store_true")
    return parser


def previous_inputs(args: argparse.Namespace, model, windows: torch.Tensor) -> torch.Tensor:
    """Inputs of block --block - 1 in the quantized model: [num_windows, T, hidden]."""
    if args.block == 1:
        if args.previous_inputs is not None:
            raise ValueError("--block 1 takes no --previous-inputs: block 0's inputs are the embeddings")
        return embedded_inputs(model, windows, args.batch_size, progress=not args.quiet)
    if args.previous_inputs is None:
        raise ValueError(f"--block {args.block} needs --previous-inputs (the inputs of block {args.block - 1})")
    hidden = load_hidden_states(args.previous_inputs, windows)
    return hidden.to(device=args.device, dtype=next(model.parameters()).dtype)


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    shared = json.loads((args.calibration_dir / "calibration.json").read_text())
    if shared.get("propagation") != "sequential":
        raise ValueError(f"{args.calibration_dir} was calibrated with propagation {shared.get('propagation')!r}; "
                         "sequential steps need `calibrate --propagation sequential`")
    windows = load_windows(args.calibration_dir / WINDOWS_FILE)
    model = load_causal_lm(args.model_dir, dtype=model_compute_dtype(args.model_dir, args.device), device=args.device)
    _, blocks = find_decoder_blocks(model)
    if not 1 <= args.block < len(blocks):
        raise ValueError(f"--block {args.block}: the model has blocks 0..{len(blocks) - 1}; block 0 is calibrated by `calibrate`")
    previous = args.block - 1
    prefix = block_prefix_of(model, previous)
    layer_files = block_layer_files(args.previous_layers_dir, prefix, blocks[previous])
    missing = [str(path) for path in layer_files.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"block {previous} is not fully quantized: missing {missing}")
    tensors = load_block_tensors(args.previous_block_tensors, prefix)
    hidden_in = previous_inputs(args, model, windows)
    stats, hidden_out = sequential_block_xtx(model, windows, args.block, hidden_in, layer_files, tensors,
                                             batch_size=args.batch_size, progress=not args.quiet)
    with artifacts.atomic_dir(args.output_dir) as staging:
        manifest = save_block_xtx(staging, {args.block: stats}, shared["source"])
        artifacts.write_json(staging / "calibration.json", {
            "propagation": "sequential",
            "block": args.block,
            "blocks": len(blocks),
            "blocks_calibrated": [args.block],
            "sites": len(manifest),
            "tokens": int(manifest["tokens"].iloc[0]),
            "source": shared["source"],
            "previous_layers_dir": str(args.previous_layers_dir),
            "previous_block_tensors": str(args.previous_block_tensors) if args.previous_block_tensors else None,
            "block_finetuned": args.previous_block_tensors is not None,
            "seconds": time.perf_counter() - started,
            "device": args.device,
        })
    save_hidden_states(args.inputs_output, hidden_out, args.block)
    return json.loads((args.output_dir / "calibration.json").read_text())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        verify_inputs(args.model_dir, args.calibration_dir, args.previous_layers_dir, args.previous_block_tensors, args.previous_inputs)
        summary = run(args)
    except (*EXPECTED_ERRORS, KeyError, ValueError) as error:
        return report_error("calibrate-block", error)
    print(f"block {summary['block']}: {summary['sites']} input sites, {summary['tokens']} tokens through the "
          f"quantized block {summary['block'] - 1} in {summary['seconds']:.1f} s -> {args.output_dir}")
    return 0
