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

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from aqflow import artifacts
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
from aqflow.models.fetch import load_causal_lm, model_compute_dtype
from aqflow.quant.representation import pack_codes, unpack_codes
from aqflow.artifacts import load_safetensors, verify_inputs
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow finetune-block", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path, help="full-precision model folder")
    parser.add_argument("--calibration-dir", required=True, type=Path, help="shared calibration folder (windows)")
    parser.add_argument("--block", required=True, type=int)
    parser.add_argument("--layers-dir", required=True, type=Path, help="folder with the block's quantized linears")
    parser.add_argument("--inputs", type=Path, default=None, help="the block's inputs (from calibrate-block); not for block 0")
    parser.add_argument("--output-dir", required=True, type=Path)
    defaults = BlockFinetuneSettings()
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quiet", action="store_true")
    return parser


def read_quantized(path: Path) -> tuple[QuantizedLinearParams, int]:
    """A layer artifact as (unpacked params, nbits)."""
    tensors = load_safetensors(path)
    nbits = tensors["codebooks"].shape[1].bit_length() - 1
    return QuantizedLinearParams(unpack_codes(tensors["codes"], nbits), tensors["codebooks"], tensors["scales"]), nbits


def run(args: argparse.Namespace) -> dict:
    settings = BlockFinetuneSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    windows = load_windows(args.calibration_dir / WINDOWS_FILE)
    # the model in its compute dtype (its own on a GPU, float32 on a CPU); only the tuned block goes to float32
    model = load_causal_lm(args.model_dir, dtype=model_compute_dtype(args.model_dir, args.device), device=args.device)
    _, blocks = find_decoder_blocks(model)
    if not 0 <= args.block < len(blocks):
        raise ValueError(f"--block {args.block}: the model has blocks 0..{len(blocks) - 1}")
    if (args.block == 0) != (args.inputs is None):
        raise ValueError("give --inputs for every block but block 0 (whose inputs are the embeddings)")
    block, prefix = blocks[args.block], block_prefix_of(model, args.block)
    files = block_layer_files(args.layers_dir, prefix, block)
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"block {args.block} is not fully quantized: missing {missing}")
    quantized = {name: read_quantized(path) for name, path in files.items()}
    call = cast_floats(block_call_inputs(model, windows, args.block), torch.float32)
    if args.inputs is None:
        hidden_in = embedded_inputs(model, windows, settings.batch_size, progress=not args.quiet)
    else:
        hidden_in = load_hidden_states(args.inputs, windows).to(args.device)
    hidden_in = hidden_in.float()
    block.float()  # targets and tuning in float32
    with torch.no_grad():  # targets: the full-precision block on the same inputs
        targets = torch.cat([block_forward(block, call, hidden_in[s:s + settings.batch_size])
                             for s in range(0, hidden_in.shape[0], settings.batch_size)])
    result = finetune_block(block, call, hidden_in, targets, {n: q for n, (q, _) in quantized.items()}, settings,
                            progress=not args.quiet)
    summary = {
        "block": args.block,
        "relative_mse_before": result.relative_mse_before,
        "relative_mse_after": result.relative_mse_after,
        "relative_mse_per_epoch": result.relative_mse_per_epoch,
        "best_epoch": result.best_epoch,
        "seconds": result.seconds,
        "settings": dataclasses.asdict(settings),
        "tuned_block_tensors": sorted(result.block_tensors),
        "device": args.device,
    }
    with artifacts.atomic_dir(args.output_dir) as staging:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        verify_inputs(args.model_dir, args.calibration_dir, args.layers_dir, args.inputs)
        summary = run(args)
    except (*EXPECTED_ERRORS, KeyError, ValueError) as error:
        return report_error("finetune-block", error)
    print(f"block {summary['block']}: relative output MSE {summary['relative_mse_before']:.5f} -> "
          f"{summary['relative_mse_after']:.5f} (best epoch {summary['best_epoch']}, {summary['seconds']:.1f} s) "
          f"-> {args.output_dir}")
    return 0
