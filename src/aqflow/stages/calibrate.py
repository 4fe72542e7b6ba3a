"""`python -m aqflow calibrate`: XᵀX of every linear's input, per block, from calibration text.

Samples a fixed, seeded set of token windows from the calibration-role documents of a corpus,
runs the full-precision model over them and writes `block{i}.npz` per block plus
`manifest.parquet` (site, linears, shape, tokens, sha256, source data), the windows
(`windows.safetensors` token ids, `windows.parquet` provenance) and `calibration.json` into
--output-dir, atomically. Every quantization variant that shares these settings reuses the result.

--propagation fp: every block. --propagation sequential: block 0 only (the full-precision model
feeds it, as in fp); block i >= 1 depends on the quantized blocks before it and is calibrated per
variant by `aqflow calibrate-block`. calibration.json lists the layers of every block either way.

XᵀX is summed in float64 on the device; where the sums of all blocks do not fit it beside the model
(Llama-3.1-8B at 128 x 4096 tokens: 66 GB of sums and 16 GB of weights on an 80 GB card), the blocks
are summed in groups, one pass over the windows each (--xtx-memory-gib; the same sums, bit for bit).

With --num-devices N > 1 the stage restarts itself under torchrun with N processes (cuda:0..N-1,
or N CPU processes with --device cpu); each takes a shard of the windows and their XᵀX are summed
(aqflow.calibration.sharded): the same result up to float64 rounding order, N model replicas,
about 1/N of the time.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.calibration.hessians import (
    MANIFEST_FILE,
    PROBE_TOKENS,
    collect_xtx_fp,
    discover_input_sites,
    save_block_xtx,
)
from aqflow.models.structure import find_decoder_blocks
from aqflow.calibration.sharded import (
    ShardingError,
    collect_xtx_fp_sharded,
    join_process_group,
    launched_world_size,
    shard_bounds,
    shard_devices,
    torchrun_command,
)
from aqflow.calibration.sequential import WINDOWS_FILE, save_windows
from aqflow.data.offline_text import CorpusError, load_split_corpus, role_texts
from aqflow.data.windows import sample_calibration_windows
from aqflow.models.fetch import ModelInputError, load_causal_lm, load_tokenizer, model_compute_dtype
from aqflow.io.artifacts import verify_inputs
from aqflow.stagekit.processes import die_with_parent
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "calibrate"
INPUT_ERRORS = (*EXPECTED_ERRORS, CorpusError, ModelInputError, ShardingError)
PROPAGATION_MODES = ("fp", "sequential")


@dataclass(frozen=True)
class CalibrateSettings:
    num_windows: int = field(default=128, metadata=option("calibration windows"))
    window_tokens: int = field(default=4096, metadata=option("tokens per window"))
    seed: int = field(default=0, metadata=option("seed of the window sampling"))
    propagation: str = field(default="fp", metadata=option(
        "fp: every block from the full-precision model; sequential: block 0 only", choices=PROPAGATION_MODES))
    batch_size: int = field(default=4, metadata=option("windows per forward pass"))
    xtx_memory_gib: float = field(default=0.0, metadata=option(
        "device memory for the float64 XᵀX sums; blocks beyond it are summed in further passes over the windows "
        "(0: what the card, or on a CPU the host, has free after the model, less room for the forward pass)"))
    device: str = field(default_factory=stage_cli.default_device)
    num_devices: int = field(default=1, metadata=option(
        "shard the windows over this many devices of --device's type (summed XᵀX)"))
    quiet: bool = field(default=False, metadata=option("no progress bar"))


@dataclass(frozen=True)
class CalibratePaths:
    model_dir: Path
    corpus: Path = field(metadata=option("corpus .parquet (from fetch-data)"))
    output_dir: Path


def calibrate(settings: CalibrateSettings, paths: CalibratePaths) -> dict:
    started = time.perf_counter()
    tokenizer = load_tokenizer(paths.model_dir)
    doc_ids, texts = role_texts(load_split_corpus(paths.corpus), "calibration")
    print(f"sampling {settings.num_windows} windows of {settings.window_tokens} tokens from {len(doc_ids)} calibration "
          f"documents ({sum(map(len, texts)) / 1e6:.0f}M characters, every one tokenized)", flush=True)
    windows = sample_calibration_windows(doc_ids, texts, tokenizer, settings.num_windows, settings.window_tokens, seed=settings.seed)
    source = f"{paths.corpus.stem}/calibration/seed{settings.seed}/{settings.num_windows}x{settings.window_tokens}"
    if launched_world_size() > 1:
        return _calibrate_one_shard(settings, paths, windows, source, started)
    model = load_causal_lm(paths.model_dir, dtype=model_compute_dtype(paths.model_dir, settings.device), device=settings.device)
    # sequential: only block 0 sees the full-precision model; the others are calibrated per variant
    if settings.propagation == "sequential":
        groups = [[0]]
    else:
        sites = discover_input_sites(model, windows.input_ids[:1, :PROBE_TOKENS])
        groups = block_groups([xtx_bytes(sites[block]) for block in sorted(sites)],
                              xtx_budget_bytes(settings, windows.input_ids.shape[1], max_in_features(sites)))
    with artifacts.atomic_dir(paths.output_dir) as staging:
        manifests = []
        for number, group in enumerate(groups, 1):
            if len(groups) > 1:
                print(f"XᵀX of blocks {group[0]}-{group[-1]}: pass {number} of {len(groups)} over the windows "
                      "(the sums of all blocks do not fit the device at once)", flush=True)
            stats = collect_xtx_fp(model, windows.input_ids, block_indices=group, batch_size=settings.batch_size,
                                   progress=not settings.quiet)
            manifests.append(save_block_xtx(staging, stats, source, write_manifest=False))
            del stats
            if torch.device(settings.device).type == "cuda":
                torch.cuda.empty_cache()
        manifest = pd.concat(manifests, ignore_index=True)
        artifacts.write_parquet(staging / MANIFEST_FILE, manifest)
        write_summary(staging, model, manifest, windows, settings, source, started, [settings.device])
    return json.loads((paths.output_dir / "calibration.json").read_text())


def xtx_bytes(sites) -> int:
    """Bytes of one block's float64 XᵀX sums (sites: its InputSites)."""
    return sum(8 * site.in_features**2 for site in sites)


def max_in_features(sites: dict) -> int:
    return max(site.in_features for block_sites in sites.values() for site in block_sites)


def block_groups(block_bytes: list[int], budget_bytes: float) -> list[list[int]]:
    """Consecutive blocks whose sums fit `budget_bytes` together, in order; a block larger than the
    budget alone is a group of its own. block_bytes[i]: bytes of block i's sums."""
    groups, current, used = [], [], 0
    for block, size in enumerate(block_bytes):
        if current and used + size > budget_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(block)
        used += size
    return groups + [current] if current else groups


def xtx_budget_bytes(settings: CalibrateSettings, window_tokens: int, widest_input: int) -> float:
    """Memory the XᵀX sums may take: --xtx-memory-gib, else what the device has free after the model
    (a card's free memory; on a CPU the host's available RAM) less room for a forward pass (4 GiB,
    plus twice the float64 copy of the widest input site's batch that accumulate_xtx makes)."""
    if settings.xtx_memory_gib > 0:
        return settings.xtx_memory_gib * 2**30
    device = torch.device(settings.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        # a 1.5B model's sums (28 x 8960^2 float64 for down_proj alone, 18 GB) outgrow a 24 GB host
        import psutil

        free = psutil.virtual_memory().available
    forward = 4 * 2**30 + 2 * 8 * settings.batch_size * window_tokens * widest_input
    return max(free - forward, 1)


def _calibrate_one_shard(settings: CalibrateSettings, paths: CalibratePaths, windows, source: str,
                         started: float) -> dict | None:
    """One process of a sharded calibration: its shard's XᵀX, summed over processes; rank 0 writes."""
    if launched_world_size() != settings.num_devices:
        raise StageInputError(f"--num-devices {settings.num_devices} but this process is one of {launched_world_size()} "
                         "(WORLD_SIZE); launch one process per device")
    device = join_process_group(settings.device)
    try:
        model = load_causal_lm(paths.model_dir, dtype=model_compute_dtype(paths.model_dir, device), device=device)
        rank = dist.get_rank()
        stats = collect_xtx_fp_sharded(model, windows.input_ids, batch_size=settings.batch_size,
                                       progress=rank == 0 and not settings.quiet)
        if rank == 0:
            devices = [f"cuda:{r}" for r in range(settings.num_devices)] if device != "cpu" else ["cpu"] * settings.num_devices
            write_calibration(model, stats, windows, settings, paths, source, started, devices)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return json.loads((paths.output_dir / "calibration.json").read_text()) if rank == 0 else None


def launch_sharded(settings: CalibrateSettings, paths: CalibratePaths) -> int:
    """Run this stage under torchrun with one process per device; the exit code of the group."""
    if settings.propagation != "fp":  # other modes calibrate block after block from quantized outputs
        raise StageInputError(f"--num-devices {settings.num_devices} shards fp propagation only, not {settings.propagation!r}")
    shard_devices(settings.device, settings.num_devices)  # names what is missing before anything starts
    shard_bounds(settings.num_windows, settings.num_devices, 0)
    command = torchrun_command(settings.num_devices, "aqflow", ["calibrate", *stage_cli.to_argv(settings, paths)])
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


def write_calibration(model, stats, windows, settings: CalibrateSettings, paths: CalibratePaths, source: str,
                      started: float, devices: list[str]) -> None:
    """block{i}.npz, manifest.parquet, windows.parquet and calibration.json, atomically."""
    with artifacts.atomic_dir(paths.output_dir) as staging:
        manifest = save_block_xtx(staging, stats, source)
        write_summary(staging, model, manifest, windows, settings, source, started, devices)


def write_summary(staging: Path, model, manifest, windows, settings: CalibrateSettings, source: str, started: float,
                  devices: list[str]) -> None:
    """windows.parquet, the windows' token ids and calibration.json, into the staging folder."""
    artifacts.write_parquet(staging / "windows.parquet", windows.to_frame())
    save_windows(staging / WINDOWS_FILE, windows.input_ids)
    layers = quantized_layer_names(model, windows.input_ids)
    summary = calibration_summary(model, manifest, layers, settings, source, started) | {"devices": devices}
    artifacts.write_json(staging / "calibration.json", summary)


def quantized_layer_names(model, windows) -> list[str]:
    """Module names of the linears of every block that the model calls (a short probe finds them),
    grouped by input site, block by block: the pipeline fans out one job per entry."""
    prefix, _ = find_decoder_blocks(model)
    sites = discover_input_sites(model, windows[:1, :PROBE_TOKENS])
    return [f"{prefix}.{block}.{linear}" for block in sorted(sites) for site in sites[block] for linear in site.linears]


def calibration_summary(model, manifest, layers: list[str], settings: CalibrateSettings, source: str,
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
        "propagation": settings.propagation,
        "device": settings.device,
    }


def run(settings: CalibrateSettings, paths: CalibratePaths) -> dict | None:
    """The calibration folder at paths.output_dir; its calibration.json (None on a process other than
    rank 0 of a sharded calibration: rank 0 reports). With num_devices > 1 the stage runs again under
    torchrun, one process per device."""
    verify_inputs(paths.model_dir, paths.corpus)
    if settings.num_devices > 1 and launched_world_size() == 1:
        code = launch_sharded(settings, paths)
        if code:
            raise StageInputError(f"the {settings.num_devices} calibration processes failed (exit code {code})")
        return json.loads((paths.output_dir / "calibration.json").read_text())
    return calibrate(settings, paths)


def summary(record: dict | None) -> str | None:
    if record is None:
        return None
    return (f"calibrated {len(record['blocks_calibrated'])} of {record['blocks']} blocks ({record['propagation']}), "
            f"{record['sites']} input sites, {record['tokens']} tokens in {record['seconds']:.1f} s")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
