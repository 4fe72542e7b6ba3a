"""2-bit decoding on a CPU: the lookup-table kernels against dense matmuls, and batch-1 decode of
whole models, on all cores (or --threads N).

    PYTHONPATH=src .venv/bin/python benchmarks/inference_cpu.py --out benchmarks/results/inference_cpu_<machine>.json \\
        [--checkpoint results/smollm2/2bpp/.../model --fp resources/models/smollm2] [--cpu-kernel avx2]

--cpu-kernel forces the kernel of 8-bit codes for every variant (cpu_dispatch: avx512, avx2, neon,
numba; `auto` takes the best this CPU runs), so an AVX-512 machine can measure the AVX2 kernel. Each
row records its kernel, with the CPU's model and SIMD flags, the commit, the date and the command.

(a) kernels: every linear shape of Llama-3.2-3B and SmolLM2-135M, one token: `lut_matmul` on 2x8
    codes against torch's dense matmul in float32 and bfloat16, cycling through copies totalling twice
    the last-level cache so every call reads DRAM as a decode step does (GB/s of the stored tensors).
    --crossover adds lut_matmul against dequantized_matmul at 1..64 tokens.
(b) decode: a Llama-3.2-3B-shaped model with seeded random weights (speed does not depend on the
    codes' values), --prompt-tokens then --new-tokens greedy tokens through greedy_decode, the
    fastest of --repeats after a warm-up, each variant (--variants) in a fresh process so its weight
    bytes and peak RSS are its own: dense float32, dense bfloat16 (torch's GEMV, and numba's bf16
    GEMV), 2x8 through FastQuantizedLinear (bf16 or float32 unquantized parts, the tied lm_head
    through numba's bf16 GEMV) and aqlm's own numba kernel (one thread, float32) unless
    --no-aqlm-kernel. `cpu_decode_speedup_3b` = tokens/s of 2x8 with bf16 unquantized parts (within
    the memory target: the float32 embedding alone is 1.5 GiB) over the best dense variant;
    `..._fp32_rest` with float32 parts; `..._cpu_time` by CPU seconds (for --threads 1 on a shared box).
(c) with --checkpoint and --fp: the real checkpoint and its fp16 source through the speed stage's
    measurement: fp in float32, bfloat16 and float16 (the speed-up is over the fastest), the
    checkpoint through the fast path (float32 and bfloat16 parts) and plain transformers + aqlm.
(d) with --checkpoint and --eval-windows: evaluate's perplexity over random windows through
    `evaluation.cpu_kernel` dense and fast, seconds and memory held, each in a fresh process.

Prints a table last; --out writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

LLAMA_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """{projection: (in, out)} of one decoder layer of a Llama shape."""
    hidden, mlp = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return {"q_proj/o_proj": (hidden, shape["num_attention_heads"] * shape["head_dim"]), "k_proj/v_proj": (hidden, kv),
            "gate_proj/up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}


def openmp_libraries() -> list[str]:
    """The OpenMP runtimes loaded in this process (torch's and numba's threads come from these: two
    different runtimes mean two thread pools, each spinning after its parallel regions)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    names = {line.split()[-1] for line in maps.read_text().splitlines() if line.split()[-1].startswith("/")}
    found = sorted(name for name in names if any(tag in Path(name).name for tag in ("gomp", "iomp", "libomp", "tbb")))
    return [shown_path(name) for name in found]


def shown_path(name: str) -> str:
    """A library's path as the results record it: inside this Python's environment relative to it
    (where a checkout's venv lives says nothing about the machine), elsewhere whole."""
    try:
        return f"<python prefix>/{Path(name).relative_to(sys.prefix)}"
    except ValueError:
        return name


def last_level_cache_bytes() -> int:
    """The largest CPU cache (sysfs), or 256 MiB where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else 256 << 20


def random_weights(out_features: int, in_features: int, generator: torch.Generator, dtype=torch.float32):
    """2x8 QuantizedWeights (2 codebooks of 256 codewords over groups of 8: 2 bits per weight)."""
    from aqflow.inference.layout import QuantizedWeights

    return QuantizedWeights(
        codes=torch.randint(0, 256, (out_features, in_features // 8, 2), generator=generator, dtype=torch.uint8),
        codebooks=(torch.randn(2, 256, 8, generator=generator) * 0.02).to(dtype),
        scales=(torch.rand(out_features, generator=generator) + 0.5).to(dtype), bias=None, nbits=8)


def time_calls(calls: list, min_seconds: float = 0.5, min_calls: int = 5) -> float:
    """The fastest call's seconds, cycling through `calls` (one warm-up round first). The minimum,
    not the median: on a shared machine a parallel call that loses a thread to another process
    waits a scheduler slice, which says nothing about the kernel."""
    for call in calls:
        call()
    times = []
    started = time.perf_counter()
    index = 0
    while len(times) < min_calls or time.perf_counter() - started < min_seconds:
        begin = time.perf_counter()
        calls[index % len(calls)]()
        times.append(time.perf_counter() - begin)
        index += 1
    return min(times)


def best_of_rounds(rounds: int, jobs: list[tuple[str, object]], key: str, larger_is_better: bool) -> list[dict]:
    """Run every job (name, zero-argument callable returning a row) once per round, the jobs in
    turn (so that a change in the machine's load spreads over all of them), and keep each job's
    best row by `key`; every round's value of `key` is kept in the row as key + "_rounds"."""
    best: dict[str, dict] = {}
    values: dict[str, list] = {name: [] for name, _ in jobs}
    for _ in range(rounds):
        for name, job in jobs:
            row = job()
            values[name].append(row[key])
            if name not in best or (row[key] > best[name][key]) == larger_is_better:
                best[name] = row
    return [{**best[name], key + "_rounds": values[name]} for name, _ in jobs]


# --- (a) kernels ------------------------------------------------------------------------------

def kernel_rows(budget_bytes: int, crossover: bool) -> list[dict]:
    from aqflow.inference import cpu_kernels

    generator = torch.Generator().manual_seed(0)
    shapes = [("llama3b", name, io) for name, io in linear_shapes(LLAMA_3B).items()]
    shapes.append(("llama3b", "lm_head", (LLAMA_3B["hidden_size"], LLAMA_3B["vocab_size"])))
    shapes += [("smollm2", name, io) for name, io in linear_shapes(SMOLLM2).items()]
    rows = []
    for model, name, (in_features, out_features) in shapes:
        x = torch.randn(1, in_features, generator=generator)
        row = {"model": model, "layer": name, "in": in_features, "out": out_features}
        dense_bytes = in_features * out_features * 4
        copies = max(1, min(1024, budget_bytes // dense_bytes))
        dense = [torch.randn(out_features, in_features, generator=generator) * 0.02 for _ in range(copies)]
        row["fp32_seconds"] = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
        dense = [w.to(torch.bfloat16) for w in dense]
        xb = x.to(torch.bfloat16)
        row["bf16_seconds"] = time_calls([lambda w=w: torch.nn.functional.linear(xb, w) for w in dense])
        del dense
        code_bytes = out_features * in_features // 4
        copies = max(1, min(1024, budget_bytes // code_bytes))
        operands = [cpu_kernels.cpu_operands(random_weights(out_features, in_features, generator)) for _ in range(copies)]
        x32 = x.numpy()
        started = time.perf_counter()
        cpu_kernels.lut_matmul_operands(x32, operands[0])
        row["lut_first_call_seconds"] = time.perf_counter() - started
        row["lut_seconds"] = time_calls([lambda o=o: cpu_kernels.lut_matmul_operands(x32, o) for o in operands])
        row["fp32_gb_per_second"] = dense_bytes / row["fp32_seconds"] / 1e9
        row["bf16_gb_per_second"] = dense_bytes / 2 / row["bf16_seconds"] / 1e9
        row["lut_gb_per_second"] = code_bytes / row["lut_seconds"] / 1e9
        row["lut_table_loads_per_second"] = out_features * in_features / 4 / row["lut_seconds"]
        row["lut_speedup_over_best_dense"] = min(row["fp32_seconds"], row["bf16_seconds"]) / row["lut_seconds"]
        if crossover and name != "lm_head":
            w = random_weights(out_features, in_features, generator)
            ops = cpu_kernels.cpu_operands(w)
            row["crossover"] = {}
            for tokens in (1, 2, 4, 8, 16, 32, 64):
                xt = torch.randn(tokens, in_features, generator=generator)
                row["crossover"][tokens] = {
                    "lut_seconds": time_calls([lambda: cpu_kernels.lut_matmul(xt, w, operands=ops)], 0.2, 3),
                    "dequantized_seconds": time_calls([lambda: cpu_kernels.dequantized_matmul(xt, w, operands=ops)], 0.2, 3)}
        del operands
        rows.append(row)
        print(f"  {model:8s} {name:18s} fp32 {row['fp32_seconds'] * 1e3:8.3f} ms  bf16 {row['bf16_seconds'] * 1e3:8.3f} ms  "
              f"lut {row['lut_seconds'] * 1e3:8.3f} ms", flush=True)
    return rows


# --- (b) decode of a random Llama-3.2-3B-shaped model --------------------------------------------

def _materialize(model, dtype: torch.dtype, generator: torch.Generator) -> None:
    """Give every parameter still on the meta device seeded random values in `dtype` on the CPU;
    rebuild the rotary embedding (its buffers are computed at construction); tie lm_head."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    tied = model.config.tie_word_embeddings
    for module in model.modules():
        if tied and module is model.lm_head:
            continue  # the embedding's weight, tied below (never a second copy)
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta:
                value = torch.empty(parameter.shape, dtype=dtype)
                if name == "weight" and value.dim() == 1:  # RMSNorm
                    value.fill_(1.0)
                else:  # in row blocks: a half-precision fill passes through float32 (a 2x transient)
                    rows = max(1, (64 << 20) // (value[0].numel() * 4)) if value.dim() > 1 else value.numel()
                    for start in range(0, value.shape[0], rows):
                        value[start:start + rows].uniform_(-0.03, 0.03, generator=generator)
                setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def random_llama(shape: dict, dtype: torch.dtype, linears: str, seed: int = 0):
    """A LlamaForCausalLM of `shape`, seeded random weights, unquantized parts in `dtype`; its
    decoder linears dense (linears="dense", in dtype), FastQuantizedLinear ("fast") or aqlm's
    QuantizedLinear ("aqlm"), the last two 2x8 with random codes. Built on the meta device first,
    so no dense copy of a quantized model is ever made."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqflow.inference.fast_linear import FastQuantizedLinear

    generator = torch.Generator().manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if linears != "dense":
        for layer in model.model.layers:
            for block in (layer.self_attn, layer.mlp):
                for name, child in list(block.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        w = random_weights(child.out_features, child.in_features, generator, dtype)
                        setattr(block, name, FastQuantizedLinear(w) if linears == "fast" else _aqlm_linear(w))
    _materialize(model, dtype, generator)
    return model.eval()


def _aqlm_linear(w):
    import transformers.quantizers  # noqa: F401  (before aqlm's integration)
    from aqlm import QuantizedLinear

    from aqflow.quant.representation import pack_codes

    layer = QuantizedLinear(w.in_features, w.out_features, in_group_size=8, out_group_size=1, num_codebooks=2,
                            nbits_per_codebook=8, bias=False, dtype=w.codebooks.dtype)
    layer.codes.data = pack_codes(w.codes.to(torch.int64), 8)
    layer.codebooks.data = w.codebooks[:, :, None, :].clone()
    layer.scales.data = w.scales.reshape(-1, 1, 1, 1).clone()
    return layer.requires_grad_(False)


def decode_child(variant: str, dtype_name: str, linears: str, prompt_tokens: int, new_tokens: int, threads: int,
                 repeats: int, bf16_gemv: bool = False, torch_thread_count: int | None = None) -> dict:
    """Build one variant and time its batch-1 decode, in this (fresh) process. bf16_gemv: its bf16
    nn.Linears (the tied lm_head; every linear of the dense bf16 model) through numba's GEMV
    (fast_linear.install_cpu_bf16_linears, as runtime.load_for_decoding's fast path on a CPU).
    torch_thread_count: torch's threads while decoding (default `threads`): the 2-bit model's
    torch ops are small (attention, norms), and torch's OpenMP pool spinning between them may
    take cores from numba's pool (a second libgomp) on a many-core host."""
    from aqflow.inference.cpu_kernels import numba_threads
    from aqflow.inference.decode import greedy_decode
    from aqflow.inference.fast_linear import install_cpu_bf16_linears
    from aqflow.inference.runtime import resident_weight_bytes
    from aqflow.stages.speed import peak_rss_bytes, random_prompt, timed_decode

    import numba

    stock = linears.endswith("-stock")  # the modules' own forwards (greedy_decode: cpu_layers' kernels)
    linears = linears.removesuffix("-stock")
    sdpa = linears.endswith("-sdpa")  # transformers' SDPA for the new token (greedy_decode: cpu_attention)
    linears = linears.removesuffix("-sdpa")
    fuse = not linears.endswith("-unfused")  # greedy_decode's fuse_projections, on by default
    linears = linears.removesuffix("-unfused")
    options = {"fuse": fuse} if not sdpa else {"fuse": fuse, "fast_attention": False}
    if stock:
        options["cpu_layers"] = False
    if linears == "fast-gathers":  # before any FastQuantizedLinear asks which CPU kernel runs
        from aqflow.inference import cpu_dispatch

        os.environ[cpu_dispatch.KERNEL_ENV] = "numba"
        linears = "fast"
    if linears in ("fast-f32-tables", "fast-f16-tables", "fast-f32-registers", "fast-i16-tables"):  # one kind for bf16
        from aqflow.inference import register_kernel

        os.environ[register_kernel.TABLES_ENV] = {"fast-f16-tables": "float16",
                                                  "fast-i16-tables": "int16"}.get(linears, "float32")
        if linears == "fast-f32-registers":  # float32 tables in registers even where byte planes run
            os.environ[register_kernel.PLANES_ENV] = "0"
        linears = "fast"
    dtype = getattr(torch, dtype_name)
    numba.set_num_threads(threads)  # numba's pool first: starting it can reset torch's count
    torch.set_num_threads(threads)
    rss_before = peak_rss_bytes()
    started = time.perf_counter()
    model = random_llama(LLAMA_3B, dtype, linears)
    if bf16_gemv:
        install_cpu_bf16_linears(model)
    build_seconds = time.perf_counter() - started
    numba_count = 1 if linears == "aqlm" else threads
    with numba_threads(numba_count):
        started = time.perf_counter()
        greedy_decode(model, random_prompt(LLAMA_3B["vocab_size"], prompt_tokens, 1), 2, **options)  # compile, caches
        warmup_seconds = time.perf_counter() - started
        torch.set_num_threads(torch_thread_count or threads)  # after numba's pool has started
        runs, cpu_rates = zip(*[timed_decode(model, random_prompt(LLAMA_3B["vocab_size"], prompt_tokens, 0), new_tokens,
                                             options, True) for _ in range(repeats)])  # else greedy_decode's defaults
    timings = max(runs, key=lambda run: run.decode_tokens_per_second)
    return {"variant": variant, "dtype": dtype_name, "linears": linears, "fused": fuse, "sdpa": sdpa,
            "cpu_layers": timings.cpu_layers, "prefetch_columns": _prefetch_columns(),
            "bf16_gemv": bf16_gemv, "threads": threads,
            "torch_threads_decoding": torch.get_num_threads(),
            "openmp_libraries": openmp_libraries(), "numba_threading_layer": _numba_layer(),
            "numba_threads": numba_count, "build_seconds": build_seconds, "warmup_seconds": warmup_seconds,
            "decode_tokens_per_second": timings.decode_tokens_per_second,
            "decode_tokens_per_second_runs": [run.decode_tokens_per_second for run in runs],
            "decode_tokens_per_cpu_second": max(cpu_rates), "decode_tokens_per_cpu_second_runs": list(cpu_rates),
            "prefill_tokens_per_second": timings.prefill_tokens_per_second,
            "decode": {"prompt_tokens": timings.prompt_tokens, "timed_steps": timings.timed_steps,
                       "decode_seconds": timings.decode_seconds},
            "cpu_kernel": _cpu_kernel(), "tables_16bit": _tables_16bit(), "float32_tables_layout": _float32_layout(),
            "resident_weight_bytes": resident_weight_bytes(model), "peak_rss_bytes": peak_rss_bytes(),
            "rss_before_build_bytes": rss_before}


def _cpu_kernel() -> str:
    """The CPU kernel this process's 8-bit-code layers take (cpu_dispatch: avx512, avx2, neon or numba)."""
    from aqflow.inference import register_kernel

    return register_kernel.kernel_name()


def _prefetch_columns() -> int | None:
    """The AVX-512 kernel's prefetch distance in this process (AQFLOW_CPU_PREFETCH), None where it does not run."""
    from aqflow.inference import cpu_dispatch, register_kernel

    return cpu_dispatch.prefetch_columns() if register_kernel.kernel_name() == "avx512" else None


def _float32_layout() -> str | None:
    """How the compiled kernel holds float32 tables in this process ("planes" or "registers" on avx512, "l1" on
    avx2 and neon), None where none runs."""
    from aqflow.inference import register_kernel

    kernels = register_kernel.compiled_kernel()
    return kernels.float32_layout if kernels is not None else None


def _tables_16bit() -> str | None:
    """The register kernel's tables for 16-bit activations in this process: as AQFLOW_CPU_TABLES names
    them, or as timed on the first product ('auto'); None where no such product ran."""
    from aqflow.inference import register_kernel

    wanted = os.environ.get(register_kernel.TABLES_ENV, "auto")
    chosen = register_kernel.chosen_tables()
    return wanted if wanted != "auto" else (", ".join(f"{v} ({k} threads)" for k, v in chosen.items()) or None)


def _numba_layer() -> str | None:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run in this process
        return None


DECODE_VARIANTS = [  # (name, dtype of the unquantized parts, linears, bf16 linears through numba's GEMV,
    #                    torch's threads while decoding: None for all)
    ("dense fp32", "float32", "dense", False, None),
    ("dense bf16", "bfloat16", "dense", False, None),
    ("dense bf16 (numba GEMV)", "bfloat16", "dense", True, None),
    ("2x8 fast (bf16 rest)", "bfloat16", "fast", True, None),
    # q/k/v and gate/up as separate products (greedy_decode fuses them by default: one call each)
    ("dense bf16 (numba GEMV, unfused)", "bfloat16", "dense-unfused", True, None),
    ("2x8 fast (bf16 rest, unfused)", "bfloat16", "fast-unfused", True, None),
    # the new token's attention through transformers' SDPA (greedy_decode's default: cpu_attention)
    ("dense bf16 (numba GEMV, SDPA)", "bfloat16", "dense-sdpa", True, None),
    ("2x8 fast (bf16 rest, SDPA)", "bfloat16", "fast-sdpa", True, None),
    # RMSNorm and rotary + cache + attention through the modules' own forwards (torch operations;
    # greedy_decode's default on a CPU: cpu_layers, one numba call each)
    ("dense bf16 (numba GEMV, stock layers)", "bfloat16", "dense-stock", True, None),
    ("2x8 fast (bf16 rest, stock layers)", "bfloat16", "fast-stock", True, None),
    # the same without a compiled kernel (AQFLOW_CPU_KERNEL=numba): the numba gather kernels
    ("2x8 fast (bf16 rest, gather kernel)", "bfloat16", "fast-gathers", True, None),
    # the register kernel with one kind of tables (by default bf16 activations take whichever timed faster)
    ("2x8 fast (bf16 rest, float32 tables)", "bfloat16", "fast-f32-tables", True, None),
    ("2x8 fast (bf16 rest, float16 tables)", "bfloat16", "fast-f16-tables", True, None),
    ("2x8 fast (bf16 rest, int16 tables)", "bfloat16", "fast-i16-tables", True, None),
    # float32 tables held as float32 registers (where the CPU has AVX-512 VBMI they are byte planes)
    ("2x8 fast (bf16 rest, float32 tables as registers)", "bfloat16", "fast-f32-registers", True, None),
    ("2x8 fast (bf16 rest, torch 1 thread)", "bfloat16", "fast", True, 1),
    ("2x8 fast (bf16 rest, torch lm_head)", "bfloat16", "fast", False, None),
    ("2x8 fast (fp32 rest)", "float32", "fast", False, None),
    ("2x8 aqlm kernel (1 thread)", "float32", "aqlm", False, None),
]
# The dense baselines the speed-up is taken over: torch's fp32 and bf16, and bf16 through the same
# numba GEMV the 2x8 model's lm_head uses (so the head's gain is not counted as the codes' gain).
DENSE_VARIANTS = ("dense fp32", "dense bf16", "dense bf16 (numba GEMV)", "dense bf16 (numba GEMV, unfused)",
                  "dense bf16 (numba GEMV, SDPA)", "dense bf16 (numba GEMV, stock layers)")


def decode_rows(args, threads: int) -> list[dict]:
    from aqflow.inference.runtime import call_in_child

    def job(name, dtype, linears, bf16_gemv, torch_thread_count):
        def run():
            new_tokens = args.aqlm_new_tokens if linears == "aqlm" else args.new_tokens
            repeats = 1 if linears == "aqlm" else args.repeats
            row = call_in_child(decode_child, name, dtype, linears, args.prompt_tokens, new_tokens, threads, repeats,
                                bf16_gemv, torch_thread_count, what=name)
            print(f"  {name:28s} {row['decode_tokens_per_second']:7.2f} tokens/s, weights "
                  f"{row['resident_weight_bytes'] / 2**30:6.2f} GiB, peak RSS {row['peak_rss_bytes'] / 2**30:6.2f} GiB"
                  + (f", tables {row['tables_16bit']}" if row.get("tables_16bit") else ""), flush=True)
            return row
        return run

    chosen = [v for v in DECODE_VARIANTS if v[2] != "aqlm" or args.aqlm_kernel]
    if args.variants is not None:  # in the order given: an order effect can be checked by reversing it
        by_name = {v[0]: v for v in chosen}
        chosen = [by_name[name] for name in args.variants if name in by_name]
    jobs = [(variant[0], job(*variant)) for variant in chosen]
    return best_of_rounds(args.rounds, jobs, "decode_tokens_per_second", True)


# --- (c) a real checkpoint ----------------------------------------------------------------------

FP_SOURCE_VARIANTS = ("fp16 source, float32", "fp16 source, bfloat16", "fp16 source, float16")

def checkpoint_rows(args, threads: int) -> list[dict]:
    from aqflow.inference.runtime import call_in_child
    from aqflow.stages.speed import measure

    settings = {"threads": threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.smol_new_tokens,
                "warmup_tokens": 4, "prefill_tokens": args.prefill_tokens, "seed": 0, "repeats": args.repeats}
    runs = [("fp16 source, float32", args.fp, "float32", "fast"), ("fp16 source, bfloat16", args.fp, "bfloat16", "fast"),
            ("fp16 source, float16", args.fp, "float16", "fast"),
            ("2 bpp, fast, float32 rest", args.checkpoint, "float32", "fast"),
            ("2 bpp, fast, bfloat16 rest", args.checkpoint, "bfloat16", "fast"),
            ("2 bpp, transformers+aqlm", args.checkpoint, "float32", "plain")]
    def job(name, folder, dtype, path):
        def run():
            row = {"variant": name, "model_dir": str(folder), "dtype": dtype,
                   **call_in_child(measure, str(folder), "cpu", dtype, path, settings, what=name)}
            print(f"  {name:28s} {row['decode_tokens_per_second']:7.2f} tokens/s, weights "
                  f"{row['resident_weight_bytes'] / 2**20:7.1f} MiB, peak RSS {row['peak_memory_bytes'] / 2**20:7.0f} MiB",
                  flush=True)
            return row
        return run

    jobs = [(name, job(name, folder, dtype, path)) for name, folder, dtype, path in runs
            if path != "plain" or args.aqlm_kernel]
    return best_of_rounds(args.rounds, jobs, "decode_tokens_per_second", True)


# --- (d) evaluation through each CPU kernel choice ------------------------------------------------

def evaluation_child(model_dir: str, kernel: str, windows: int, context: int, batch_size: int, threads: int) -> dict:
    """Perplexity of seeded random windows through evaluate's model loading with cpu_kernel
    `kernel`, in this (fresh) process: seconds, the value (equal across kernels up to float
    rounding) and the memory held."""
    from aqflow.evaluation.perplexity import perplexity
    from aqflow.inference.runtime import resident_weight_bytes, torch_threads
    from aqflow.stages.evaluate import load_model
    from aqflow.stages.speed import peak_rss_bytes

    started = time.perf_counter()
    model = load_model(Path(model_dir), "float32", "cpu", cpu_kernel=kernel)
    load_seconds = time.perf_counter() - started
    ids = torch.randint(0, model.config.vocab_size, (windows, context), generator=torch.Generator().manual_seed(0))
    with torch_threads(threads):  # torch's and numba's threads alike
        perplexity(model, ids[:1, :16], progress=False)  # warm-up: kernels compiled or loaded from the cache
        started = time.perf_counter()
        value = perplexity(model, ids, batch_size=batch_size, progress=False)
    return {"kernel": kernel, "load_seconds": load_seconds, "perplexity_seconds": time.perf_counter() - started,
            "perplexity": value, "tokens": windows * context, "resident_weight_bytes": resident_weight_bytes(model),
            "peak_rss_bytes": peak_rss_bytes(), "threads": threads}


def evaluation_rows(args, threads: int) -> list[dict]:
    from aqflow.inference.runtime import call_in_child

    def job(kernel):
        def run():
            row = call_in_child(evaluation_child, str(args.checkpoint), kernel, args.eval_windows, args.eval_context,
                                args.eval_batch_size, threads, what=f"evaluation through {kernel}")
            print(f"  cpu_kernel {kernel:6s} {row['perplexity_seconds']:7.2f} s for {row['tokens']} tokens, perplexity "
                  f"{row['perplexity']:.4f}, weights {row['resident_weight_bytes'] / 2**20:.1f} MiB", flush=True)
            return row
        return run

    return best_of_rounds(args.rounds, [(kernel, job(kernel)) for kernel in ("dense", "fast")], "perplexity_seconds", False)


# --- report ---------------------------------------------------------------------------------------

def package_version(name: str) -> str | None:
    """The installed version of `name`, None where it is not installed (aqlm on a bare GPU box)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# The CPU flags that decide the lookup kernel (cpu_dispatch) and its table kinds (register_kernel)
KERNEL_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni", "asimd")


def machine() -> dict:
    from aqflow.inference import cpu_dispatch
    from aqflow.stages.speed import device_name

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    flags = cpu_dispatch.cpu_flags()
    return {"cpu": device_name("cpu"), "cores": os.cpu_count(), "platform": platform.platform(),
            "cpu_flags": [flag for flag in KERNEL_CPU_FLAGS if flag in flags],
            "cpu_kernels_runnable": cpu_dispatch.runnable_kernels(),
            "last_level_cache_bytes": last_level_cache_bytes(), "load_average_at_start": load,
            "torch": torch.__version__, **{name: package_version(name) for name in ("transformers", "numba", "aqlm")}}


def git_commit() -> str | None:
    """The checkout's commit (with "+changes" where tracked files differ from it), None outside git."""
    import subprocess

    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def speedup(rows: list[dict], fast: str, dense: tuple[str, ...], key: str = "decode_tokens_per_second") -> float | None:
    """Decode tokens/s of `fast` over the best of `dense` (by `key`)."""
    by_name = {row["variant"]: row[key] for row in rows}
    best = max((by_name[name] for name in dense if name in by_name), default=None)
    return by_name[fast] / best if best and fast in by_name else None


def table(record: dict) -> str:
    lines = [f"machine: {record['machine']['cpu']}, {record['machine']['cores']} cores, threads {record['threads']}"
             + (f", CPU kernel {record['cpu_kernel']}" if record.get("cpu_kernel") else "")]
    if record.get("kernels"):
        lines.append(f"{'kernel (1 token)':30s} {'fp32 ms':>8s} {'bf16 ms':>8s} {'lut ms':>8s} {'fp32 GB/s':>9s} "
                     f"{'bf16 GB/s':>9s} {'lut GB/s':>8s} {'lut/best':>8s}")
        for r in record["kernels"]:
            lines.append(f"{r['model'] + ' ' + r['layer']:30s} {r['fp32_seconds'] * 1e3:8.3f} {r['bf16_seconds'] * 1e3:8.3f} "
                         f"{r['lut_seconds'] * 1e3:8.3f} {r['fp32_gb_per_second']:9.1f} {r['bf16_gb_per_second']:9.1f} "
                         f"{r['lut_gb_per_second']:8.1f} {r['lut_speedup_over_best_dense']:7.2f}x")
    for key, title, unit in (("decode_3b", "Llama-3.2-3B shape, batch-1 decode", 2**30),
                             ("smollm2", "SmolLM2-135M checkpoint, batch-1 decode", 2**20)):
        if record.get(key):
            suffix = "GiB" if unit == 2**30 else "MiB"
            lines.append(f"{title:36s} {'tokens/s':>9s} {'tok/CPU-s':>9s} {'weights ' + suffix:>12s} "
                         f"{'peak RSS ' + suffix:>13s}")
            for r in record[key]:
                peak = r.get("peak_rss_bytes", r.get("peak_memory_bytes"))
                kernel = f"  {r['cpu_kernel']}" if r.get("cpu_kernel") and r.get("linears") == "fast" else ""
                lines.append(f"{r['variant']:36s} {r['decode_tokens_per_second']:9.2f} {r['decode_tokens_per_cpu_second']:9.2f} "
                             f"{r['resident_weight_bytes'] / unit:12.2f} {peak / unit:13.2f}{kernel}")
    if record.get("evaluation"):
        lines.append(f"{'evaluation of the checkpoint (perplexity)':44s} {'seconds':>8s} {'perplexity':>11s} {'weights MiB':>12s}")
        for r in record["evaluation"]:
            lines.append(f"{'cpu_kernel ' + r['kernel']:44s} {r['perplexity_seconds']:8.2f} {r['perplexity']:11.4f} "
                         f"{r['resident_weight_bytes'] / 2**20:12.1f}")
    for suffix in ("", "_cpu_time"):
        if record.get("smollm2_compared" + suffix):
            pair = record["smollm2_compared" + suffix]
            lines.append(f"smollm2_compared{suffix}: {pair['2 bpp']} over {pair['dense']}")
    for key in ("cpu_decode_speedup_3b", "cpu_decode_speedup_3b_cpu_time", "cpu_decode_speedup_3b_fp32_rest",
                "cpu_decode_speedup_3b_torch_1_thread", "cpu_resident_fraction_of_bf16_3b",
                "smollm2_decode_speedup_over_fp16_source", "smollm2_decode_speedup_over_fp16_source_cpu_time"):
        if record.get(key) is not None:
            lines.append(f"{key}: {record[key]:.3f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and numba threads (default: all cores)")
    parser.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip (a)")
    parser.add_argument("--crossover", action="store_true", help="(a): lut against dequantized at 1..64 tokens")
    parser.add_argument("--no-decode", dest="decode", action="store_false", help="skip (b)")
    parser.add_argument("--no-aqlm-kernel", dest="aqlm_kernel", action="store_false", help="skip aqlm's own kernel")
    parser.add_argument("--cpu-kernel", default="auto", choices=("auto", "avx512", "avx2", "neon", "numba"),
                        help="the lookup kernel of 8-bit codes for every variant (AQFLOW_CPU_KERNEL; auto: the best "
                             "this CPU runs)")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8, help="(b): timed decode tokens (+1 from the prefill)")
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="(b): only these variants, in this order (names as printed; default: all)")
    parser.add_argument("--aqlm-new-tokens", type=int, default=3, help="(b): for aqlm's one-thread kernel")
    parser.add_argument("--repeats", type=int, default=3,
                        help="(b), (c): decode this many times per variant, keep the fastest (a shared machine)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="(b), (c), (d): measure all variants this many times in turn, keep each one's best "
                             "(a machine whose load changes)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="(c): a SmolLM2 AQLM checkpoint (model/)")
    parser.add_argument("--fp", type=Path, default=None, help="(c): its fp source folder")
    parser.add_argument("--smol-new-tokens", type=int, default=64, help="(c): decode tokens")
    parser.add_argument("--eval-windows", type=int, default=0,
                        help="(d): with --checkpoint, time evaluate's perplexity over this many random windows "
                             "through cpu_kernel dense and fast (0: skip)")
    parser.add_argument("--eval-context", type=int, default=512, help="(d): tokens per window (the demo's context)")
    parser.add_argument("--eval-batch-size", type=int, default=1, help="(d): windows per forward")
    parser.add_argument("--prefill-tokens", type=int, default=256, help="(c): the long prompt")
    args = parser.parse_args()
    if (args.checkpoint is None) != (args.fp is None):
        parser.error("--checkpoint and --fp go together")
    if args.aqlm_kernel and package_version("aqlm") is None:
        # (b) and (c) still measure the project's own path and the dense baselines
        print("aqlm is not installed: its kernel is left out (as with --no-aqlm-kernel)", flush=True)
        args.aqlm_kernel = False

    import numba

    from aqflow.inference import cpu_dispatch, register_kernel

    os.environ[cpu_dispatch.KERNEL_ENV] = args.cpu_kernel  # inherited by every measuring child
    cpu_kernel = register_kernel.kernel_name()  # checked here: one this CPU cannot run is an error before any run
    threads = min(args.threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)  # numba's pool first: starting it can reset torch's count
    torch.set_num_threads(threads)
    record = {"machine": machine(), "threads": threads, "cpu_kernel": cpu_kernel, "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "command": " ".join(["benchmarks/inference_cpu.py", *sys.argv[1:]]),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    started = time.perf_counter()
    if args.kernels:
        print("(a) kernels, one token", flush=True)
        record["kernels"] = kernel_rows(2 * record["machine"]["last_level_cache_bytes"], args.crossover)
    if args.decode:
        print("(b) Llama-3.2-3B-shaped decode", flush=True)
        record["decode_3b"] = decode_rows(args, threads)
        record["cpu_decode_speedup_3b"] = speedup(record["decode_3b"], "2x8 fast (bf16 rest)", DENSE_VARIANTS)
        record["cpu_decode_speedup_3b_cpu_time"] = speedup(record["decode_3b"], "2x8 fast (bf16 rest)",
                                                           DENSE_VARIANTS, "decode_tokens_per_cpu_second")
        record["cpu_decode_speedup_3b_fp32_rest"] = speedup(record["decode_3b"], "2x8 fast (fp32 rest)",
                                                            DENSE_VARIANTS)
        record["cpu_decode_speedup_3b_torch_1_thread"] = speedup(
            record["decode_3b"], "2x8 fast (bf16 rest, torch 1 thread)", DENSE_VARIANTS)
        by_name = {row["variant"]: row for row in record["decode_3b"]}
        if "2x8 fast (bf16 rest)" in by_name and "dense bf16" in by_name:
            record["cpu_resident_fraction_of_bf16_3b"] = (by_name["2x8 fast (bf16 rest)"]["resident_weight_bytes"]
                                                          / by_name["dense bf16"]["resident_weight_bytes"])
    if args.checkpoint is not None:
        print("(c) SmolLM2 checkpoint", flush=True)
        record["smollm2"] = checkpoint_rows(args, threads)
        for suffix, key in (("", "decode_tokens_per_second"), ("_cpu_time", "decode_tokens_per_cpu_second")):
            fast = max(("2 bpp, fast, float32 rest", "2 bpp, fast, bfloat16 rest"),
                       key=lambda name: {r["variant"]: r[key] for r in record["smollm2"]}[name])
            record["smollm2_decode_speedup_over_fp16_source" + suffix] = speedup(
                record["smollm2"], fast, FP_SOURCE_VARIANTS, key)
            by_name = {r["variant"]: r[key] for r in record["smollm2"]}
            record["smollm2_compared" + suffix] = {"2 bpp": fast, "dense": max(
                (name for name in FP_SOURCE_VARIANTS if name in by_name), key=by_name.get)}
    if args.checkpoint is not None and args.eval_windows > 0:
        print("(d) evaluation through cpu_kernel dense and fast", flush=True)
        record["evaluation"] = evaluation_rows(args, threads)
    record["seconds"] = time.perf_counter() - started
    record["machine"]["openmp_libraries"] = openmp_libraries()
    record["machine"]["numba_threading_layer"] = _numba_layer()
    record["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.out is not None:
        from aqflow.io.artifacts import atomic_path

        with atomic_path(args.out, checksum=False) as tmp:  # a run cut short leaves no half-written file
            tmp.write_text(json.dumps(record, indent=2) + "\n")
    print(table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
