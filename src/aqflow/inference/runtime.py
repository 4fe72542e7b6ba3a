"""A model folder loaded for decoding, through one of two paths, and what it holds in memory.

    fast:  the project's fastest path for the device: AQLM layers become FastQuantizedLinear
           (lookup-table kernels, 2-bit in memory); on a CPU bfloat16 linears (the tied lm_head)
           become CpuBf16Linear (numba's bf16 GEMV); then q/k/v and gate/up are fused
           (decode.fuse_projections); greedy_decode replays the step as a CUDA graph on CUDA.
    plain: transformers + aqlm as they load the folder (aqlm's own kernels), decoded eagerly with
           nothing fused (decode_options), for comparison.

Plain folders (the fp model) go through the same two paths (fused projections or not), so an fp
model and its compressed variants are timed by the same harness.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

from aqflow.models.fetch import load_causal_lm, model_compute_dtype
from aqflow.models.folder import quantization_config, weight_files

PATHS = ("fast", "plain")


def is_aqlm_folder(model_dir: str | os.PathLike) -> bool:
    config = quantization_config(model_dir)
    return config is not None and config.get("quant_method") == "aqlm"


def resolve_dtype(model_dir: str | os.PathLike, device: str, dtype: str) -> str:
    """auto: the pipeline's compute dtype (float32 on a CPU, the folder's dtype on a GPU)."""
    return model_compute_dtype(model_dir, device) if dtype == "auto" else dtype


def load_for_decoding(model_dir: str | os.PathLike, device: str, dtype: str = "auto", path: str = "fast") -> torch.nn.Module:
    """The model of `model_dir` on `device` in `dtype` (see resolve_dtype), in eval mode, set up for
    `path` (fast or plain, see the module's doc)."""
    if path not in PATHS:
        raise ValueError(f"path {path!r}: expected one of {PATHS}")
    if is_aqlm_folder(model_dir):
        import transformers.quantizers  # noqa: F401  (transformers 5: before aqlm's integration)
    model = load_causal_lm(model_dir, dtype=resolve_dtype(model_dir, device, dtype), device=device)
    if path == "fast":
        from aqflow.inference.decode import fuse_projections
        from aqflow.inference.fast_linear import install_cpu_bf16_linears, install_fast_linears

        install_fast_linears(model)
        if torch.device(device).type == "cpu":  # bf16 linears left dense (the tied lm_head): numba's GEMV
            install_cpu_bf16_linears(model)
        fuse_projections(model)  # after the swaps above, so their layers fuse with their own kind
    return model


def decode_options(path: str) -> dict:
    """greedy_decode's keyword arguments for decoding through `path`. fast: the device's defaults (on
    CUDA fused projections, one-token attention kernels, the step compiled and replayed as a CUDA
    graph); plain: eager steps, the projections and the attention as transformers loaded them
    (greedy_decode would change both on CUDA otherwise)."""
    if path not in PATHS:
        raise ValueError(f"path {path!r}: expected one of {PATHS}")
    return {} if path == "fast" else {"graphs": False, "fuse": False, "fast_attention": False}


def decoding_context(model_dir: str | os.PathLike, device: str, path: str) -> ContextManager:
    """What decoding through `path` must run inside: aqlm's CPU kernel (plain path, AQLM folder)
    races with more than one numba thread, so it gets one."""
    if path == "plain" and torch.device(device).type == "cpu" and is_aqlm_folder(model_dir):
        from aqflow.inference.cpu_kernels import numba_threads

        return numba_threads(1)
    return nullcontext()


def lookup_kernel(model_dir: str | os.PathLike, device: str, path: str) -> str | None:
    """The kernel the 2-bit layers of an AQLM folder take on a CPU through `path`: on the fast path the
    one cpu_dispatch chose for this process (avx512, avx2, neon or numba), on the plain path "aqlm"
    (aqlm's own numba kernel); None on a GPU or for a plain folder (nothing 2-bit to look up)."""
    if torch.device(device).type != "cpu" or not is_aqlm_folder(model_dir):
        return None
    if path == "plain":
        return "aqlm"
    from aqflow.inference.register_kernel import kernel_name

    return kernel_name()


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as held (a tensor shared by several modules,
    e.g. tied embeddings, counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


def disk_weight_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the folder's weight files."""
    return sum(path.stat().st_size for path in weight_files(Path(model_dir)))


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch and numba on `threads` threads (None: as they are), restored after.

    numba's count is set first: the first numba.set_num_threads of a process starts numba's
    OpenMP pool, which can set torch's OpenMP count back to NUMBA_NUM_THREADS (seen with torch
    2.11 and numba's omp layer: torch on 2 threads where 1 was asked, on a 2-core box)."""
    if threads is None:
        yield
        return
    from aqflow.inference.cpu_kernels import numba_threads

    before = torch.get_num_threads()
    try:
        with numba_threads(threads):
            torch.set_num_threads(threads)
            yield
    finally:
        torch.set_num_threads(before)


def _child_main(connection, function: Callable[..., Any], args: tuple) -> None:
    try:
        connection.send(("ok", function(*args)))
    except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def call_in_child(function: Callable[..., Any], *args: Any, what: str = "a measurement") -> Any:
    """function(*args) in a fresh spawned process (its peak memory and thread pools its own); the
    result must pickle. A failure in the child raises RuntimeError with the child's traceback."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(sender, function, args))
    child.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"{what}: the child process died (exit code {child.exitcode}); out of memory?") from None
    child.join()
    if status != "ok":
        raise RuntimeError(f"{what} failed in a child process:\n{payload}")
    return payload
