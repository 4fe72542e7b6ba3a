"""The CUDA C++ lookup-table GEMVs for 2x8 AQLM linears (csrc/lut_gemv*.cu), built at first use.

Split-K kernel (csrc/lut_gemv.cu, up to 4 tokens): a CTA builds the lookup tables of a chunk of input
groups in shared memory (tensor-core products of the token with the codebooks, fp32 accumulation;
fp32 or fp16 entries), then sweeps many rows of codes with one shared-memory read and one add per
code; split-K sums meet in an fp32 workspace and the last CTA of each row block finishes them
(scales, bias, cast) and leaves workspace and counters at zero, so a CUDA graph can replay the
launch. Cluster kernel (csrc/lut_gemv_cluster.cu, one token): the CTAs splitting one row block's
input groups form a thread-block cluster and add their sums through each other's shared memory,
after requesting every code at once: one trip to device memory per launch where the split-K kernel
makes four or five in a row. Both are launched with programmatic dependent launch inside
`dependent_launch.enabled()` (the decode step's default on Hopper): their codes are requested before
they wait for the kernel before them. Design, predictions and resource use:
benchmarks/inference_gpu_notes.md.

The extension is compiled by `torch.utils.cpp_extension.load` from the package's .cu/.cpp files on first
use (about a minute; cached in TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). `load` rather
than `load_inline`: the inline form prepends torch's headers to the CUDA file, which makes nvcc compile
them too. It runs inside the `aqflow::packed_matmul` custom op (gpu_kernels), as the variants
`cuda_lut32` / `cuda_cluster32` (fp32 tables) and `cuda_lut16` / `cuda_cluster16` (fp16 tables);
geometries other than 2x8 over groups of 8, and any failure to build, fall back to the Triton
kernels. AQFLOW_CUDA_KERNELS=0 turns it off.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from aqflow.inference import dependent_launch

if TYPE_CHECKING:  # gpu_kernels imports this module
    from aqflow.inference.packed import KernelConfig, PackedWeights

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("lut_gemv_binding.cpp", "lut_gemv.cu", "lut_gemv_cluster.cu")
EXTENSION_NAME = "aqflow_lut_gemv"
VARIANT_ENTRY_BITS = {"cuda_lut32": 32, "cuda_lut16": 16, "cuda_cluster32": 32, "cuda_cluster16": 16}
CLUSTER_VARIANTS = ("cuda_cluster32", "cuda_cluster16")
SPLIT_K_VARIANTS = ("cuda_lut32", "cuda_lut16")  # the split-K kernel's: those that can leave their sums open
CLUSTER_MAX_CHUNKS = {256: 4, 128: 8}  # rows per CTA -> most chunks a CTA holds codes of (lut_gemv_cluster.cu)
CLUSTER_MAX_RANKS = 16
ROWS_PER_BATCH = 256  # rows a CTA sweeps at a time (8 warps x 4 rows x 8 row slots); rows_per_cta is a multiple
GROUPS_PER_CHUNK = 16
CLUSTER_MAX_GROUPS = CLUSTER_MAX_RANKS * max(CLUSTER_MAX_CHUNKS.values()) * GROUPS_PER_CHUNK  # 16 CTAs x 8 chunks
MAX_TOKENS = 4
MAX_SHARED_BYTES = 200 * 1024  # leave room under the 227 KB a CTA may have
UNIT_PAIR_BYTES = 256 * 256  # two table units interleaved in 256-byte lines (csrc/lut_gemv_common.cuh)

_state: dict = {"module": None, "error": None, "seconds": None}
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("AQFLOW_CUDA_KERNELS", "1") != "0"


def nvcc_arch_flags(capability: tuple[int, int]) -> list[str]:
    """-gencode for the device's own architecture (sm_90 on H100/H200: no PTX JIT at start)."""
    major, minor = capability
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def compile_flags(capability: tuple[int, int]) -> list[str]:
    return ["-O3", *nvcc_arch_flags(capability)]  # the language standard is torch's own choice


def load_extension(verbose: bool = False):
    """The compiled extension (built on first call, then cached); raises RuntimeError if it cannot be built."""
    with _lock:
        if _state["module"] is not None:
            return _state["module"]
        if _state["error"] is not None:
            raise RuntimeError(f"the CUDA LUT extension failed to build earlier: {_state['error']}")
        if not enabled():
            raise RuntimeError("the CUDA LUT kernels are turned off (AQFLOW_CUDA_KERNELS=0)")
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA LUT kernels need a CUDA device")
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        try:
            capability = torch.cuda.get_device_capability()
            module = load(name=EXTENSION_NAME, sources=[str(SOURCE_DIR / s) for s in SOURCES],
                          extra_include_paths=[str(SOURCE_DIR)], extra_cflags=["-O2"],
                          extra_cuda_cflags=compile_flags(capability), verbose=verbose)
        except Exception as error:  # noqa: BLE001 - remembered: the Triton kernels take over
            _state["error"] = f"{type(error).__name__}: {str(error)[-2000:]}"
            _state["seconds"] = time.perf_counter() - start
            raise RuntimeError(f"building the CUDA LUT extension failed: {_state['error']}") from error
        _state["module"], _state["seconds"] = module, time.perf_counter() - start
        return module


def build_in_background(verbose: bool = False) -> threading.Thread:
    """Starts load_extension in a thread (the build is mostly nvcc in a subprocess, so other GPU work goes on)."""

    def build() -> None:
        try:
            load_extension(verbose=verbose)
        except RuntimeError:
            pass  # recorded in status()

    thread = threading.Thread(target=build, name="aqflow-cuda-build", daemon=True)
    thread.start()
    return thread


def status() -> dict:
    """{'built': bool, 'seconds': build (or failed build) seconds, 'error': message or None}."""
    return {"built": _state["module"] is not None, "seconds": _state["seconds"], "error": _state["error"]}


def ready() -> bool:
    """True once the extension is loaded in this process (no build is started)."""
    return _state["module"] is not None


def applies(packed: "PackedWeights", tokens: int) -> bool:
    """2 codebooks of 256 codewords over groups of 8, uint8 codes, bf16/fp16, an even group count, <= 4 tokens."""
    return (packed.codes.is_cuda and packed.codes.dtype == torch.uint8 and packed.num_codebooks == 2
            and packed.codebook_size == 256 and packed.group_size == 8 and packed.num_groups % 2 == 0
            and packed.codebooks.dtype in (torch.bfloat16, torch.float16) and 1 <= tokens <= MAX_TOKENS
            and len(packed.out_sizes) <= 4)


def cluster_takes(packed: "PackedWeights", tokens: int) -> bool:
    """Whether the cluster kernel takes this shape (on top of `applies`): one token, at most
    CLUSTER_MAX_GROUPS input groups."""
    return tokens == 1 and packed.num_groups <= CLUSTER_MAX_GROUPS


def max_tokens_for(tokens: int) -> int:
    """The compiled token width a launch of `tokens` tokens uses (1 or 4)."""
    return 1 if tokens == 1 else MAX_TOKENS


def shared_bytes(entry_bits: int, tokens: int, chunks_per_cta: int) -> int:
    units = (chunks_per_cta + 1) // 2 if entry_bits == 16 else chunks_per_cta
    return _cdiv(units * max_tokens_for(tokens), 2) * UNIT_PAIR_BYTES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_blocks(packed: "PackedWeights", rows_per_cta: int) -> int:
    return sum(_cdiv(rows, rows_per_cta) for rows in packed.out_sizes)


def make_config(packed: "PackedWeights", variant: str, rows_per_cta: int, chunks_per_cta: int) -> "KernelConfig":
    """A KernelConfig for the CUDA kernel: block_rows = rows per CTA, block_groups = groups per CTA,
    split = the resulting split-K depth, num_warps = 8 (fixed by the kernel)."""
    from aqflow.inference.packed import KernelConfig

    groups_per_cta = GROUPS_PER_CHUNK * chunks_per_cta
    return KernelConfig(variant, rows_per_cta, groups_per_cta, _cdiv(packed.num_groups, groups_per_cta), 8)


def default_config(packed: "PackedWeights", tokens: int, multiprocessors: int) -> "KernelConfig":
    """fp32 tables of 2 chunks (64 KB at one token, up to three CTAs per SM; 1 chunk for more tokens)
    and rows per CTA giving about two CTAs per SM in all, at least 512 rows (the table build is paid once
    per CTA)."""
    chunks = min(2 if max_tokens_for(tokens) == 1 else 1, _cdiv(packed.num_groups, GROUPS_PER_CHUNK))
    splits = _cdiv(packed.num_groups, GROUPS_PER_CHUNK * chunks)
    wanted_blocks = max(1, _cdiv(2 * multiprocessors, splits))
    rows = max(512, _cdiv(_cdiv(packed.rows, wanted_blocks), ROWS_PER_BATCH) * ROWS_PER_BATCH)
    rows = min(rows, _cdiv(max(packed.out_sizes), ROWS_PER_BATCH) * ROWS_PER_BATCH)
    return make_config(packed, "cuda_lut32", rows, chunks)


def candidate_configs(packed: "PackedWeights", tokens: int, multiprocessors: int) -> list["KernelConfig"]:
    """Configurations worth timing: fp32 and fp16 tables, 1-8 chunks of 16 groups, 256-4096 rows per CTA,
    keeping shared memory under MAX_SHARED_BYTES and between ~1/2 and ~12 CTAs per multiprocessor."""
    configs = []
    tallest = _cdiv(max(packed.out_sizes), ROWS_PER_BATCH) * ROWS_PER_BATCH
    for variant, chunk_choices in (("cuda_lut32", (1, 2, 4)), ("cuda_lut16", (2, 4, 8))):
        for chunks in chunk_choices:
            if shared_bytes(VARIANT_ENTRY_BITS[variant], tokens, chunks) > MAX_SHARED_BYTES:
                continue
            if GROUPS_PER_CHUNK * chunks > packed.num_groups and chunks > 1:
                continue
            splits = _cdiv(packed.num_groups, GROUPS_PER_CHUNK * chunks)
            for rows in (256, 512, 1024, 2048, 4096):
                if rows > tallest:
                    continue
                ctas = row_blocks(packed, rows) * splits
                if multiprocessors // 2 <= ctas <= 12 * multiprocessors:
                    configs.append(make_config(packed, variant, rows, chunks))
    if cluster_takes(packed, tokens):
        configs += cluster_candidate_configs(packed)
    default = default_config(packed, tokens, multiprocessors)
    return [default] + [c for c in configs if c != default]


def cluster_candidate_configs(packed: "PackedWeights") -> list["KernelConfig"]:
    """The cluster kernel's configurations: fp32 and fp16 tables, 256 or 128 rows per CTA, and for each
    cluster size (<= 16 CTAs) the fewest chunks per CTA that give it (more would only idle)."""
    from aqflow.inference.packed import KernelConfig

    chunks_total = _cdiv(packed.num_groups, GROUPS_PER_CHUNK)
    configs = []
    for variant in CLUSTER_VARIANTS:
        for rows, most_chunks in CLUSTER_MAX_CHUNKS.items():
            seen_ranks = set()
            for chunks in range(1, most_chunks + 1):
                ranks = _cdiv(packed.num_groups, GROUPS_PER_CHUNK * chunks)
                if ranks > CLUSTER_MAX_RANKS or ranks in seen_ranks:
                    continue
                seen_ranks.add(ranks)
                chunks = _cdiv(chunks_total, ranks)  # the fewest chunks per CTA at this cluster size
                configs.append(KernelConfig(variant, rows, GROUPS_PER_CHUNK * chunks, ranks, 8))
    return configs


def _checked(x: torch.Tensor, packed: "PackedWeights", config: "KernelConfig") -> torch.Tensor:
    """x as the kernels take it (4-byte aligned) after checking that `config` fits x and packed."""
    if config.variant not in VARIANT_ENTRY_BITS:
        raise ValueError(f"not a CUDA LUT variant: {config.variant!r}")
    if not applies(packed, x.shape[0]):
        raise ValueError("the CUDA LUT kernel takes 2 codebooks of 256 codewords over groups of 8 (uint8 codes, "
                         f"bf16/fp16, an even group count) and 1..{MAX_TOKENS} tokens")
    cluster = config.variant in CLUSTER_VARIANTS
    rows_ok = config.block_rows in CLUSTER_MAX_CHUNKS if cluster else config.block_rows % ROWS_PER_BATCH == 0
    if config.block_groups % GROUPS_PER_CHUNK or not rows_ok:
        raise ValueError(f"{config.label()}: groups per CTA must be a multiple of {GROUPS_PER_CHUNK}, rows "
                         f"{'128 or 256' if cluster else f'a multiple of {ROWS_PER_BATCH}'}")
    if cluster and not cluster_takes(packed, x.shape[0]):
        raise ValueError(f"{config.label()}: the cluster kernel takes one token and at most {CLUSTER_MAX_GROUPS} groups")
    return x.clone() if x.data_ptr() % 4 else x  # a view starting at an odd element: read as 4-byte words


def _call_on_device(x: torch.Tensor, function, args: tuple) -> None:
    if x.device.index is not None and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            function(*args)
    else:
        function(*args)


def launch(x: torch.Tensor, packed: "PackedWeights", config: "KernelConfig", out: torch.Tensor,
           workspace: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """x [T, in] contiguous, T <= 4 -> out [T, rows] (written in full). workspace (fp32) and counters
    (int32) zero before and after."""
    x = _checked(x, packed, config)
    module = load_extension()
    stream = torch.cuda.current_stream(x.device).cuda_stream
    chunks = config.block_groups // GROUPS_PER_CHUNK
    common = (x, packed.codes, packed.codebooks, packed.scales, packed.bias, out)
    pdl = dependent_launch.active()
    if config.variant in CLUSTER_VARIANTS:
        function = module.lut_gemv_2x8_cluster
        args = (*common, list(packed.out_sizes), config.block_rows, chunks, VARIANT_ENTRY_BITS[config.variant],
                pdl, stream)
    else:
        function = module.lut_gemv_2x8
        args = (*common, workspace, counters, list(packed.out_sizes), config.block_rows, chunks,
                VARIANT_ENTRY_BITS[config.variant], max_tokens_for(x.shape[0]), pdl, stream)
    _call_on_device(x, function, args)
    return out


def launch_open(x: torch.Tensor, packed: "PackedWeights", config: "KernelConfig", sums: torch.Tensor) -> torch.Tensor:
    """x [T, in] contiguous, T <= 4: adds each row's unscaled sum of table entries into sums [T, rows] fp32
    (zero before: no scales, no bias, nothing else written), for a caller that finishes them (`open_sums`).
    The split-K kernel (cuda_lut32 / cuda_lut16) without its finishing pass."""
    if config.variant not in SPLIT_K_VARIANTS:
        raise ValueError(f"{config.label()}: open sums are the split-K kernel's ({', '.join(SPLIT_K_VARIANTS)})")
    x = _checked(x, packed, config)
    module = load_extension()
    stream = torch.cuda.current_stream(x.device).cuda_stream
    args = (x, packed.codes, packed.codebooks, packed.scales, packed.bias, sums, list(packed.out_sizes),
            config.block_rows, config.block_groups // GROUPS_PER_CHUNK, VARIANT_ENTRY_BITS[config.variant],
            max_tokens_for(x.shape[0]), dependent_launch.active(), stream)
    _call_on_device(x, module.lut_gemv_2x8_open, args)
    return sums
