"""`python -m aqflow calibrate`: XᵀX of every linear's input, per block, from calibration text.

Samples a fixed, seeded set of token windows from the calibration-role documents of a corpus,
runs the full-precision model over them and writes `block{i}.npz` per block plus
`manifest.parquet` (site, linears, shape, tokens, sha256, source data), the windows
(`windows.safetensors` token ids, `windows.parquet` provenance) and `calibration.json` into
--output-dir, atomically. Every quantization variant that shares these settings reuses the result.

--propagation fp: every block. --propagation sequential: block 0 only (the full-precision model
feeds it, as in fp); block i >= 1 depends on the quantized blocks before it and is calibrated per
variant by `aqflow calibrate-block`. calibration.json lists the layers of every block either way.

With --num-devices N > 1 the stage restarts itself under torchrun with N processes (cuda:0..N-1,
or N CPU processes with --device cpu); each takes a shard of the windows and their XᵀX are summed
(aqflow.calibration.sharded): the same result up to float64 rounding order, N model replicas,
about 1/N of the time.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from aqflow import artifacts
from aqflow.calibration.hessians import (
    PROBE_TOKENS,
    collect_xtx_fp,
    discover_input_sites,
    save_block_xtx,
)
from aqflow.models.structure import find_decoder_blocks
from aqflow.calibration.sharded import (
    collect_xtx_fp_sharded,
    join_process_group,
    launched_world_size,
    shard_bounds,
    shard_devices,
    torchrun_command,
)
from aqflow.calibration.sequential import WINDOWS_FILE, save_windows
from aqflow.data.offline_text import load_split_corpus, role_texts
from aqflow.data.windows import sample_calibration_windows
from aqflow.models.fetch import load_causal_lm, load_tokenizer, model_compute_dtype
from aqflow.artifacts import verify_inputs
from aqflow.processes import die_with_parent
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error

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
    parser.add_argument("--num-devices", type=int, default=1,
                        help="shard the windows over this many devices of --device's type (summed XᵀX)")
    parser.add_argument("--quiet", action="store_true")
    return parser


def calibrate(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model_dir)
    doc_ids, texts = role_texts(load_split_corpus(args.corpus), "calibration")
    windows = sample_calibration_windows(doc_ids, texts, tokenizer, args.num_windows, args.window_tokens, seed=args.seed)
    source = f"{args.corpus.stem}/calibration/seed{args.seed}/{args.num_windows}x{args.window_tokens}"
    if launched_world_size() > 1:
        return _calibrate_one_shard(args, windows, source, started)
    model = load_causal_lm(args.model_dir, dtype=model_compute_dtype(args.model_dir, args.device), device=args.device)
    # sequential: only block 0 sees the full-precision model; the others are calibrated per variant
    blocks = [0] if args.propagation == "sequential" else None
    stats = collect_xtx_fp(model, windows.input_ids, block_indices=blocks, batch_size=args.batch_size,
                           progress=not args.quiet)
    write_calibration(model, stats, windows, args, source, started, [args.device])
    return json.loads((args.output_dir / "calibration.json").read_text())


def _calibrate_one_shard(args: argparse.Namespace, windows, source: str, started: float) -> dict | None:
    """One process of a sharded calibration: its shard's XᵀX, summed over processes; rank 0 writes."""
    if launched_world_size() != args.num_devices:
        raise ValueError(f"--num-devices {args.num_devices} but this process is one of {launched_world_size()} "
                         "(WORLD_SIZE); launch one process per device")
    device = join_process_group(args.device)
    try:
        model = load_causal_lm(args.model_dir, dtype=model_compute_dtype(args.model_dir, device), device=device)
        rank = dist.get_rank()
        stats = collect_xtx_fp_sharded(model, windows.input_ids, batch_size=args.batch_size,
                                       progress=rank == 0 and not args.quiet)
        if rank == 0:
            devices = [f"cuda:{r}" for r in range(args.num_devices)] if device != "cpu" else ["cpu"] * args.num_devices
            write_calibration(model, stats, windows, args, source, started, devices)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return json.loads((args.output_dir / "calibration.json").read_text()) if rank == 0 else None


def launch_sharded(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this stage under torchrun with one process per device; the exit code of the group."""
    if args.propagation != "fp":  # other modes calibrate block after block from quantized outputs
        raise ValueError(f"--num-devices {args.num_devices} shards fp propagation only, not {args.propagation!r}")
    shard_devices(args.device, args.num_devices)  # names what is missing before anything starts
    shard_bounds(args.num_windows, args.num_devices, 0)
    command = torchrun_command(args.num_devices, "aqflow", ["calibrate", *argv])
    print(" ".join(command), flush=True)
    stdout, stderr = _real_stream(sys.stdout), _real_stream(sys.stderr)
    result = subprocess.run(command, stdout=stdout or subprocess.PIPE, stderr=stderr or subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    for captured, stream in ((result.stdout, sys.stdout), (result.stderr, sys.stderr)):
        if captured:  # only where the stream had no file descriptor to hand down
            stream.write(captured)
    return result.returncode


def _real_stream(stream):
    """`stream` when it has a file descriptor a child can write to (a log file, a terminal), else None."""
    try:
        stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    return stream


def write_calibration(model, stats, windows, args: argparse.Namespace, source: str, started: float,
                      devices: list[str]) -> None:
    """block{i}.npz, manifest.parquet, windows.parquet and calibration.json, atomically."""
    with artifacts.atomic_dir(args.output_dir) as staging:
        manifest = save_block_xtx(staging, stats, source)
        artifacts.write_parquet(staging / "windows.parquet", windows.to_frame())
        save_windows(staging / WINDOWS_FILE, windows.input_ids)
        layers = quantized_layer_names(model, windows.input_ids)
        summary = calibration_summary(model, manifest, layers, args, source, started) | {"devices": devices}
        artifacts.write_json(staging / "calibration.json", summary)


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
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        verify_inputs(args.model_dir, args.corpus)
        if args.num_devices > 1 and launched_world_size() == 1:
            code = launch_sharded(args, argv)
            if code:
                print(f"aqflow calibrate: error: the {args.num_devices} calibration processes failed "
                      f"(exit code {code})", file=sys.stderr)
                return code
            summary = json.loads((args.output_dir / "calibration.json").read_text())
        else:
            summary = calibrate(args)
    except (*EXPECTED_ERRORS, KeyError, ValueError) as error:
        return report_error("calibrate", error)
    if summary is None:  # a rank other than 0 of a sharded calibration: rank 0 reports
        return 0
    print(f"calibrated {len(summary['blocks_calibrated'])} of {summary['blocks']} blocks ({args.propagation}), {summary['sites']} input sites, {summary['tokens']} tokens "
          f"in {summary['seconds']:.1f} s -> {args.output_dir}")
    return 0
