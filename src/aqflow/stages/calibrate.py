"""`python -m aqflow calibrate`: XᵀX of every linear's input, per block, from calibration text.

Samples a fixed, seeded set of token windows from the calibration-role documents of a corpus,
runs the full-precision model over them and writes `block{i}.npz` per block plus
`manifest.parquet` (site, linears, shape, tokens, sha256, source data), the windows
(`windows.safetensors` token ids, `windows.parquet` provenance) and `calibration.json` into
--output-dir, atomically. Every quantization variant that shares these settings reuses the result.

--propagation fp: every block. --propagation sequential: block 0 only (the full-precision model
feeds it, as in fp); block i >= 1 depends on the quantized blocks before it and is calibrated per
variant by `aqflow calibrate-block`. calibration.json lists the layers of every block either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from aqflow import artifacts
from aqflow.calibration.hessians import (
    PROBE_TOKENS,
    collect_xtx_fp,
    discover_input_sites,
    find_decoder_blocks,
    save_block_xtx,
)
from aqflow.calibration.sequential import WINDOWS_FILE, save_windows
from aqflow.data.offline_text import load_split_corpus, role_texts
from aqflow.data.windows import sample_calibration_windows
from aqflow.models.fetch import load_causal_lm, load_tokenizer

PROPAGATION_MODES = ("fp", "sequential")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow calibrate", description=__doc__)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--corpus", required=True, type=Path, help="corpus .parquet (from fetch-data)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--num-windows", type=int, default=128)
    parser.add_argument("--window-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--propagation", default="fp", choices=PROPAGATION_MODES)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quiet", action="store_true")
    return parser


def calibrate(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model_dir)
    doc_ids, texts = role_texts(load_split_corpus(args.corpus), "calibration")
    windows = sample_calibration_windows(doc_ids, texts, tokenizer, args.num_windows, args.window_tokens, seed=args.seed)
    model = load_causal_lm(args.model_dir, dtype="float32" if args.device == "cpu" else "bfloat16", device=args.device)
    # sequential: only block 0 sees the full-precision model; the others are calibrated per variant
    blocks = [0] if args.propagation == "sequential" else None
    stats = collect_xtx_fp(model, windows.input_ids, block_indices=blocks, batch_size=args.batch_size,
                           progress=not args.quiet)
    layers = quantized_layer_names(model, windows.input_ids)
    source = f"{args.corpus.stem}/calibration/seed{args.seed}/{args.num_windows}x{args.window_tokens}"
    with artifacts.atomic_dir(args.output_dir) as staging:
        manifest = save_block_xtx(staging, stats, source)
        artifacts.write_parquet(staging / "windows.parquet", windows.to_frame())
        save_windows(staging / WINDOWS_FILE, windows.input_ids)
        artifacts.write_json(staging / "calibration.json",
                             calibration_summary(model, manifest, layers, args, source, started))
    return json.loads((args.output_dir / "calibration.json").read_text())


def quantized_layer_names(model, windows) -> list[str]:
    """Module names of the linears of every block that the model calls (a short probe finds them),
    grouped by input site, block by block: the pipeline fans out one job per entry."""
    prefix, _ = find_decoder_blocks(model)
    sites = discover_input_sites(model, windows[:1, :PROBE_TOKENS])
    return [f"{prefix}.{block}.{linear}" for block in sorted(sites) for site in sites[block] for linear in site.linears]


def calibration_summary(model, manifest, layers: list[str], args: argparse.Namespace, source: str,
                        started: float) -> dict:
    """What calibration.json records, with the module names of every linear to quantize."""
    _, blocks = find_decoder_blocks(model)
    return {
        "layers": layers,
        "blocks": len(blocks),
        "blocks_calibrated": sorted(int(b) for b in manifest["block"].unique()),
        "sites": len(manifest),
        "tokens": int(manifest["tokens"].iloc[0]),
        "seconds": time.perf_counter() - started,
        "source": source,
        "propagation": args.propagation,
        "device": args.device,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = calibrate(args)
    except (FileNotFoundError, KeyError, ValueError) as error:
        print(f"aqflow calibrate: error: {error}", file=sys.stderr)
        return 2
    print(f"calibrated {len(summary['blocks_calibrated'])} of {summary['blocks']} blocks ({args.propagation}), {summary['sites']} input sites, {summary['tokens']} tokens "
          f"in {summary['seconds']:.1f} s -> {args.output_dir}")
    return 0
