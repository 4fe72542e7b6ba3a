"""XᵀX over several devices of one host: the calibration windows are split into shards, one per
process (one process per GPU, or several CPU processes), and the partial sums are added.

XᵀX is a sum over tokens, XᵀX = Σ_t x_t x_tᵀ, and in `fp` propagation every window's tokens go
through the same full-precision model whatever else is in the batch, so

    XᵀX(all windows) = Σ_r XᵀX(shard r),   tokens(all) = Σ_r tokens(shard r)

exactly in real arithmetic; in float64 the sums differ from the single-device result only in
rounding order (relative differences around 1e-15). Each process holds a full replica of the model
and its own accumulators; one all-reduce per input site adds them (NCCL between GPUs, gloo on CPU).

Runs under any `torch.distributed` launcher: `aqflow calibrate --num-devices N` starts itself under
torchrun (one process per device, `torchrun_command`), each process joins the group
(`join_process_group`) and takes shard r = its rank.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from .hessians import BlockXtx, collect_xtx_fp


class ShardingError(ValueError):
    """A sharded calibration that cannot run as asked (devices, windows); the message says why."""


def shard_bounds(num_windows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous shard of `num_windows` windows; sizes differ by at most 1."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if num_windows < world_size:
        raise ShardingError(f"{num_windows} calibration windows cannot be shared by {world_size} devices; "
                         "use at least one window per device")
    base, extra = divmod(num_windows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@torch.no_grad()
def collect_xtx_fp_sharded(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8,
                           xtx_device: str | torch.device | None = None,
                           progress: bool = False) -> dict[int, BlockXtx]:
    """`collect_xtx_fp` over this rank's shard of `windows` [num_windows, T], then summed over ranks.

    Every rank returns the same result: block index -> BlockXtx of all windows (tokens =
    num_windows · T). The default process group must be initialised; the accumulators must live
    on a device the backend can reduce (the model's device for NCCL, CPU for gloo).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("collect_xtx_fp_sharded needs an initialised torch.distributed process group")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start, stop = shard_bounds(windows.shape[0], world_size, rank)
    stats = collect_xtx_fp(model, windows[start:stop], batch_size=batch_size, xtx_device=xtx_device,
                           progress=progress)
    layout = [(i, [site.site_id for site in stats[i].sites]) for i in sorted(stats)]
    layouts: list = [None] * world_size
    dist.all_gather_object(layouts, layout)
    if any(other != layout for other in layouts):
        raise RuntimeError(f"ranks found different blocks or input sites: {layouts}")
    for i, site_ids in layout:
        for site_id in site_ids:
            dist.all_reduce(stats[i].xtx[site_id], op=dist.ReduceOp.SUM)
            tokens = torch.tensor([stats[i].tokens[site_id]], dtype=torch.int64, device=stats[i].xtx[site_id].device)
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM)
            stats[i].tokens[site_id] = int(tokens.item())
    return stats


def shard_devices(device: str, num_devices: int) -> list[str]:
    """The device of each rank: cuda:0..N-1 for a CUDA device type, N CPU processes for "cpu"."""
    if num_devices < 1:
        raise ShardingError(f"num_devices must be at least 1, got {num_devices}")
    kind = torch.device(device).type
    if kind == "cpu":
        return ["cpu"] * num_devices
    if kind != "cuda":
        raise ShardingError(f"sharded calibration runs on cuda or cpu devices, not {device!r}")
    if num_devices == 1:
        return [device]
    available = torch.cuda.device_count()
    if available < num_devices:
        raise ShardingError(f"{num_devices} devices asked for, but {available} CUDA devices are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return [f"cuda:{i}" for i in range(num_devices)]


def launched_world_size() -> int:
    """Processes in the torchrun (or Slurm srun + torchrun) world this process belongs to; 1 outside."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def torchrun_command(num_processes: int, module: str, argv: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m module argv`: N local
    processes with a private rendezvous on a free port, so several jobs can share a host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}",
            "-m", module, *argv]


def join_process_group(device: str) -> str:
    """Join the process group torchrun describes in the environment; return this rank's device.

    device: the device type of every rank ("cuda" or "cpu"); rank r of a CUDA world uses
    cuda:LOCAL_RANK (NCCL), CPU worlds use gloo and split the cores between the processes.
    """
    from aqflow.stagekit.processes import die_with_parent

    die_with_parent()  # torchrun's workers die with it (it cannot pass a SIGKILL on)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = launched_world_size()
    if torch.device(device).type == "cuda":
        rank_device = f"cuda:{local_rank}"
        torch.cuda.set_device(torch.device(rank_device))
        backend = "nccl"
    else:
        rank_device = "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
        backend = "gloo"
    dist.init_process_group(backend)
    return rank_device
