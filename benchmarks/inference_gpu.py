"""Batch-1 decoding on the GPU: our AQLM 2x8 kernels (CUDA C++ lookup tables first, Triton as fallback)
against bf16 (cuBLAS), per linear and end to end, at the Llama-3.2-3B and Llama-3.1-8B shapes (issue 27).

Within about 4 minutes (--budget-seconds), on one card (--device-index), while the CUDA extension
(aqflow/inference/csrc) builds in a background thread, per model:
1. bf16 with seeded random weights, q/k/v and gate/up fused as ours: decode eager, CUDA graph,
   torch.compile + graph; prefill at a long prompt; the LM head alone; one graphed step's kernels by kind.
2. per decode shape, every kernel candidate (CUDA first, then a few Triton tiles) is checked against the
   float64 dense reference with its output poisoned with NaN (a wrong one is dropped), then timed (L2
   flushed); the fastest correct one is what the model runs.
3. the same model with random 2x8 codes: graph, compile + graph, prefill, step profile; aqlm's own kernel
   with --aqlm (its first build takes about a minute). --checkpoint DIR / --fp DIR: an AQLM checkpoint the
   pipeline wrote and its fp source.

Every part catches its own failures; results are saved after every part. Prints a short table last and
writes JSON (--out, default $OUT/inference_gpu.json) with gpu_decode_speedup_3b / _8b: ours (best of
graph, compile+graph) over the best bf16 decode of the same model.

CPU dry run of the whole script (Triton's interpreter, tiny model, no CUDA kernel):
    python benchmarks/inference_gpu.py --device cpu --tiny --out /tmp/inference_dry
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run in Triton's interpreter on a CPU
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # aqlm's CPU kernel races with more threads

import torch

from aqflow.inference import cuda_kernels
from aqflow.inference import gpu_kernels as gk
from aqflow.inference.decode import fuse_projections, greedy_decode
from aqflow.inference.layout import QuantizedWeights
from aqflow.inference.packed import in_tiles

SHAPES = {
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, head_dim=16, tie_word_embeddings=False),
}
GEOMETRY = dict(num_codebooks=2, nbits=8, group_size=8)  # 2x8: 2 bits per weight
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - STARTED


def guarded(record: dict, key: str, fn, *args, **kwargs):
    """Runs fn, storing its result (or its error) under record[key]; never raises."""
    try:
        record[key] = fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - one failing part must not end the run
        record[key] = {"error": f"{type(error).__name__}: {error}"}
        log(f"{key} FAILED: {type(error).__name__}: {error}")
        traceback.print_exc(limit=4)
    return record[key]


# ---------------------------------------------------------------- weights

def random_quantized(out_features: int, in_features: int, device, dtype, generator: torch.Generator,
                     bias: bool = False) -> QuantizedWeights:
    """Random 2x8 codes, codebooks of unit-variance codewords and scales giving weights of ~0.02 RMS."""
    m, nbits, g = GEOMETRY["num_codebooks"], GEOMETRY["nbits"], GEOMETRY["group_size"]
    k = 1 << nbits
    codes = torch.randint(0, k, (out_features, in_features // g, m), generator=generator, device=device,
                          dtype=torch.int32).to(torch.uint8)
    codebooks = torch.randn(m, k, g, generator=generator, device=device).to(dtype)
    scales = torch.full((out_features,), 0.02 / m ** 0.5, device=device, dtype=dtype)
    bias_values = torch.randn(out_features, generator=generator, device=device).to(dtype) * 0.02 if bias else None
    return QuantizedWeights(codes, codebooks, scales, bias_values, nbits)


def linear_shapes(shape: dict) -> dict[str, tuple[list[int], int]]:
    """Linear name -> (output sizes, in_features); fused entries list several outputs."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    return {"q_proj": ([q], h), "k_proj": ([kv], h), "v_proj": ([kv], h), "o_proj": ([h], q),
            "gate_proj": ([i], h), "up_proj": ([i], h), "down_proj": ([h], i),
            "qkv (fused)": ([q, kv, kv], h), "gate+up (fused)": ([i, i], h)}


# ---------------------------------------------------------------- aqlm

def aqlm_available() -> str | None:
    try:
        import aqlm  # noqa: F401

        return getattr(aqlm, "__version__", "?")
    except Exception:  # noqa: BLE001
        return None


def aqlm_linear(w: QuantizedWeights) -> torch.nn.Module:
    """aqlm's QuantizedLinear holding the same codes (signed as aqlm stores them)."""
    from aqlm import QuantizedLinear

    m, k, g = w.codebooks.shape
    layer = QuantizedLinear(w.in_features, w.out_features, in_group_size=g, out_group_size=1, num_codebooks=m,
                            nbits_per_codebook=w.nbits, bias=w.bias is not None, device=w.codes.device,
                            dtype=w.codebooks.dtype)
    signed = w.codes.to(torch.int16)
    signed = torch.where(signed >= (1 << (w.nbits - 1)), signed - (1 << w.nbits), signed)
    layer.codes.data = signed.to(layer.codes.dtype).contiguous()
    layer.codebooks.data = w.codebooks[:, :, None, :].contiguous()
    layer.scales.data = w.scales.view(-1, 1, 1, 1).contiguous()
    if w.bias is not None:
        layer.bias.data = w.bias.clone()
    return layer


# ---------------------------------------------------------------- 1. kernels

DECODE_LINEARS = ("qkv (fused)", "o_proj", "gate+up (fused)", "down_proj")  # what a decode step runs
# The Triton fallback's search space here: tile shapes that won a decode shape in the first GPU run, at one
# split depth each (every Triton tile shape is a JIT compile of a second or two; the CUDA kernel has none)
TRITON_TILES = {"direct16": [(32, 8, 4), (64, 4, 4)], "lut": [(256, 8, 8)]}


def wait_for_extension(args, thread) -> dict:
    """Waits for the background build of the CUDA extension (until --build-wait-seconds into the run at
    most); returns its status (built, seconds, error)."""
    if thread is not None and thread.is_alive():
        log(f"waiting for the CUDA extension build (up to {args.build_wait_seconds:.0f} s into the run)")
        thread.join(timeout=max(0.0, args.build_wait_seconds - elapsed()))
    status = cuda_kernels.status()
    if thread is not None and thread.is_alive():
        status = {**status, "error": "still building: tuned without it"}
    return status


def bench_kernels(shape_name: str, args, device, dtype, names, with_aqlm: bool) -> dict:
    """Checks and times every candidate configuration of the named linears; records the fastest correct one
    (which the models then run)."""
    shape = SHAPES[shape_name]
    generator = torch.Generator(device=device).manual_seed(0)
    results = {}
    for name in [n for n in names if n in linear_shapes(shape)]:
        outs, in_features = linear_shapes(shape)[name]
        row = results[name] = {"out": sum(outs), "in": in_features}
        ws = [random_quantized(o, in_features, device, dtype, generator) for o in outs]
        packed = in_tiles(gk.pack_weights(ws))  # as the decode holds them (decode.FusedQuantizedLinear)
        x = torch.randn(1, in_features, device=device, generator=generator).to(dtype)
        dense = torch.randn(sum(outs), in_features, device=device, generator=generator).to(dtype) * 0.02
        bf16_seconds = gk.median_seconds(lambda weight=dense: torch.nn.functional.linear(x, weight))
        row["bf16_us"] = bf16_seconds * 1e6
        row["bf16_GBps"] = dense.numel() * dense.element_size() / bf16_seconds / 1e9
        if device.type == "cuda":  # as a decode step runs it: back to back in a graph, weights past the L2
            bf16_seconds = dense_graph_seconds(x, dense)
            row["bf16_graph_us"] = bf16_seconds * 1e6
        del dense
        if with_aqlm and aqlm_available() and len(ws) == 1:
            guarded(row, "aqlm", bench_aqlm_linear, ws[0], x)
        candidates = gk.candidate_configs(packed, 1, triton_tiles=TRITON_TILES, programs_per_sm=(8,))
        if args.tiny:  # the interpreter is slow: one candidate per variant
            candidates = list({c.variant: c for c in reversed(candidates)}.values())
        cuda_count = sum(c.variant.startswith("cuda") for c in candidates)
        log(f"{shape_name} {name} [{sum(outs)} x {in_features}]: bf16 {row['bf16_us']:.1f} us"
            + (f" ({row['bf16_graph_us']:.1f} us in a graph)" if "bf16_graph_us" in row else "")
            + f"; {len(candidates)} candidates ({cuda_count} CUDA)")
        timing = "graph" if device.type == "cuda" else "launch"
        row["timing"] = timing
        # timed as the decode runs them: the split-K candidates with open sums (greedy_decode's default on CUDA)
        tuned = gk.tune(packed, 1, configs=candidates, check=True, rtol=args.rtol, log=log if args.verbose else None,
                        timing=timing, open_sums=True)
        row["candidates"] = [{"config": c.label(), "us": None if s is None else s * 1e6, "note": note}
                             for c, s, note in tuned]
        timed = [(c, s) for c, s, _ in tuned if s is not None]
        failed = [(c.label(), note) for c, s, note in tuned if s is None]
        if failed:
            log(f"  {len(failed)} candidates dropped, e.g. {failed[0]}")
        if not timed:
            row["ours"] = {"error": "no candidate passed"}
            continue
        best, seconds = min(timed, key=lambda cs: cs[1])
        per_variant = {}
        for config, s in timed:
            if config.variant not in per_variant or s < per_variant[config.variant][1]:
                per_variant[config.variant] = (config, s)
        error = kernel_error(packed, x, best)
        row["ours"] = {"config": best.label(), "us": seconds * 1e6, "rel_error": error,
                       "GBps": packed.code_bytes() / seconds / 1e9,
                       "best_per_variant": {v: {"config": c.label(), "us": s * 1e6} for v, (c, s) in per_variant.items()}}
        row["speedup_over_bf16"] = bf16_seconds / seconds
        log(f"  ours {best.label()} {seconds * 1e6:.1f} us ({row['ours']['GBps']:.0f} GB/s of codes, rel. error "
            f"{error:.1e}), x{row['speedup_over_bf16']:.2f} over bf16; per variant: "
            + ", ".join(f"{v} {s * 1e6:.1f}" for v, (c, s) in per_variant.items()))
    return results


def dense_graph_seconds(x: torch.Tensor, dense: torch.Tensor, replays: int = 10) -> float:
    """Seconds per cuBLAS GEMV in a CUDA graph of launches over enough weight copies to pass the L2
    (the same measure `gk.tune(timing="graph")` gives our kernels)."""
    copies = gk.graph_copies(dense.numel() * dense.element_size(), x.device)
    weights = [dense] + [dense.clone() for _ in range(copies - 1)]

    def launch_all() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)

    return gk.graph_replay_seconds(launch_all, copies, x.device, replays)


def kernel_error(packed: gk.PackedWeights, x: torch.Tensor, config: gk.KernelConfig) -> float:
    reference = x.double() @ gk.packed_dense_weight(packed).double().T
    out = torch.full((x.shape[0], packed.rows), float("nan"), dtype=x.dtype, device=x.device)
    gk._launch(x, packed, config, out)
    return gk.relative_error(out, reference)


def bench_aqlm_linear(w: QuantizedWeights, x: torch.Tensor) -> dict:
    layer = aqlm_linear(w)
    with torch.no_grad():
        y = layer(x)
        error = gk.relative_error(y, x.double() @ gk.packed_dense_weight(gk.as_packed(w)).double().T)
        seconds = gk.median_seconds(lambda: layer(x))
    return {"us": seconds * 1e6, "rel_error": error, "GBps": w.codes.numel() / seconds / 1e9}


# ---------------------------------------------------------------- 2. models

def build_llama(shape_name: str, device, dtype, seed: int = 0):
    """A Llama of the named shape with seeded random weights (std 0.02, norms at 1), in dtype on device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape_name], max_position_embeddings=8192, rope_theta=500000.0,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, device=device, dtype=torch.float32)
                                .mul_(0.02).to(dtype))
    return model.eval()


def block_linears(model) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) of every projection in the decoder layers."""
    found = []
    for layer in model.model.layers:
        for block_name, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            block = getattr(layer, block_name)
            found += [(block, n, getattr(block, n)) for n in names]
    return found


def quantize_randomly(model, kind: str, seed: int = 1) -> None:
    """Replaces every decoder projection by a random 2x8 layer: ours ('ours') or aqlm's ('aqlm')."""
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    for parent, name, module in block_linears(model):
        w = random_quantized(module.out_features, module.in_features, device, dtype, generator,
                             bias=getattr(module, "bias", None) is not None)
        setattr(parent, name, gk.KernelQuantizedLinear(w) if kind == "ours" else aqlm_linear(w))
        del module
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def resident_bytes(model) -> int:
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_run(model, args, device, *, graphs: bool, compile: bool = False, new_tokens: int | None = None) -> dict:
    """One greedy decode through aqflow.inference.decode (projections already fused; its default attention,
    launches and sums); with graphs, the kernels of one graphed step are profiled (an untimed step)."""
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=generator)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens, timings = greedy_decode(model, prompt, new_tokens or args.new_tokens, graphs=graphs, compile=compile,
                                    fuse=False, profile=graphs)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result = {"mode": timings.mode, "attention": timings.attention, "dependent_launch": timings.dependent_launch,
              "open_sums": timings.open_sums, "cuda_layers": timings.cuda_layers,
              "decode_tokens_per_second": timings.decode_tokens_per_second,
              "ms_per_token": 1e3 / timings.decode_tokens_per_second, "timed_steps": timings.timed_steps,
              "capture_seconds": timings.capture_seconds, "peak_bytes": peak, "first_tokens": tokens[:8].tolist()}
    if timings.compile_error:
        result["compile_error"] = timings.compile_error
    if timings.step_kernels:
        result["profile"] = summarize_kernels(timings.step_kernels)
    log(f"  decode {result['mode']:14s} ({timings.attention}{', PDL' if timings.dependent_launch else ''}"
        f"{f', open sums {timings.open_sums}' if timings.open_sums else ''}"
        f"{f', rope in attention {timings.cuda_layers}' if timings.cuda_layers else ''}) "
        f"{result['decode_tokens_per_second']:8.1f} tokens/s "
        f"({result['ms_per_token']:.2f} ms/token; setup {timings.capture_seconds:.1f} s)"
        + (f"; one step: {profile_line(result['profile'])}" if "profile" in result else ""))
    return result


def logits_check(model, device) -> dict:
    """The whole model on one token through the kernels as configured (fused packs, tuned variants) against
    the same model through the dequantized dense weights: relative error of the logits (both bf16, so a
    few 1e-3 per layer add up; garbage would be ~1)."""
    ids = torch.tensor([[1]], device=device)
    with torch.inference_mode():
        fast = model(input_ids=ids).logits.double()
        kernel_tokens = gk.MAX_KERNEL_TOKENS
        gk.MAX_KERNEL_TOKENS = 0  # every product through the dense path
        try:
            dense = model(input_ids=ids).logits.double()
        finally:
            gk.MAX_KERNEL_TOKENS = kernel_tokens
    error = gk.relative_error(fast, dense)
    result = {"rel_error": error, "ok": error < 5e-2}
    log(f"  logits through the kernels vs dense weights: rel. error {error:.1e}" + ("" if result["ok"] else " WRONG"))
    return result


def prefill_run(model, args, device) -> dict:
    generator = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prefill_tokens), generator=generator)
    runs = [greedy_decode(model, prompt, 1, graphs=False, compile=False, fuse=False)[1] for _ in range(2)]
    seconds = runs[-1].prefill_seconds  # the first warms up
    result = {"prompt_tokens": args.prefill_tokens, "seconds": seconds,
              "tokens_per_second": args.prefill_tokens / seconds}
    log(f"  prefill {args.prefill_tokens} tokens: {result['tokens_per_second']:.0f} tokens/s")
    return result


def remaining(args) -> float:
    return args.budget_seconds - elapsed()


COMPILE_SECONDS = {"estimate": 35.0}  # one model's compile+graph setup; the first measured one replaces it


def compile_fits(args, shape_name: str, runs_left: int, reserve: float) -> bool:
    """Whether runs_left compiled decodes (about COMPILE_SECONDS each) still fit in the budget with
    `reserve` seconds left for the rest."""
    if args.compile == "none" or (args.compile == "3b" and shape_name not in ("3b", "tiny")):
        return False
    return remaining(args) > runs_left * COMPILE_SECONDS["estimate"] + reserve


def note_compile_seconds(run: dict) -> None:
    if isinstance(run, dict) and run.get("mode", "").startswith("compile"):
        COMPILE_SECONDS["estimate"] = max(COMPILE_SECONDS["estimate"] * 0.5, run["capture_seconds"] * 1.15)


def compiled_run(record: dict, model, args, device) -> None:
    """The compile+graph decode into record; its setup time refines the next compile's estimate."""
    note_compile_seconds(guarded(record, "compile+graph", decode_run, model, args, device, graphs=True, compile=True))


def bench_model(shape_name: str, args, device, dtype, kernels: dict, build_thread) -> dict:
    """bf16 decode (eager, graph, compile+graph), the kernels of this shape tuned, then the same model with
    random 2x8 codes through them (graph, compile+graph), aqlm's kernel last if asked."""
    record: dict = {"shape": SHAPES[shape_name]}
    cuda = device.type == "cuda"
    log(f"model {shape_name}: building bf16")
    model = build_llama(shape_name, device, dtype)
    bf16 = record["bf16"] = {"resident_bytes": resident_bytes(model)}
    fuse_projections(model)  # the same fusion for both: one GEMV for q/k/v and one for gate/up
    # compiling is on for both kinds or for neither (the comparison stays fair); decided before either
    compiled = cuda and compile_fits(args, shape_name, 2, reserve=60 if shape_name == "3b" else 35)
    record["compiled"] = compiled
    guarded(bf16, "eager", decode_run, model, args, device, graphs=False, new_tokens=min(args.new_tokens, 16))
    if cuda:
        guarded(bf16, "graph", decode_run, model, args, device, graphs=True)
        if compiled:
            compiled_run(bf16, model, args, device)
    if not args.quick and remaining(args) > 90:
        guarded(bf16, "prefill", prefill_run, model, args, device)
    if cuda:
        guarded(bf16, "head", time_head, model)
    save_progress()

    if not args.skip_kernels:
        if cuda and cuda_kernels.enabled():
            kernels["cuda_extension"] = wait_for_extension(args, build_thread)
            log(f"CUDA extension: {kernels['cuda_extension']}")
        guarded(kernels, "linears", bench_kernels, shape_name, args, device, dtype, DECODE_LINEARS, False)
        save_progress()

    log(f"model {shape_name}: random 2x8 codes (ours)")
    quantize_randomly(model, "ours")
    ours = record["ours"] = {"resident_bytes": resident_bytes(model)}
    ours["fused_groups"] = len(fuse_projections(model))
    guarded(ours, "logits_check", logits_check, model, device)
    if cuda:
        guarded(ours, "graph", decode_run, model, args, device, graphs=True)
        if compiled:
            compiled_run(ours, model, args, device)
    else:
        guarded(ours, "eager", decode_run, model, args, device, graphs=False, new_tokens=min(args.new_tokens, 16))
    if not args.quick and remaining(args) > 45:
        guarded(ours, "prefill", prefill_run, model, args, device)
    record["speedup"] = decode_speedup(record)
    log(f"model {shape_name}: ours / best bf16 decode = {record['speedup']}")
    if args.aqlm and aqlm_available() and remaining(args) > 90:  # its first use builds CUDA code
        log(f"model {shape_name}: random 2x8 codes (aqlm)")
        quantize_randomly(model, "aqlm")
        record["aqlm"] = {"resident_bytes": resident_bytes(model)}
        guarded(record["aqlm"], "graph" if cuda else "eager", decode_run, model, args, device, graphs=cuda,
                new_tokens=None if cuda else min(args.new_tokens, 16))
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return record


FLOOR_PREFIX = "floor"  # runs that decode wrong tokens by design (earlier files' norms-as-identity runs): never the best


def best_rate(record: dict) -> float | None:
    rates = [run["decode_tokens_per_second"] for key, run in record.items()
             if isinstance(run, dict) and "decode_tokens_per_second" in run and not key.startswith(FLOOR_PREFIX)]
    return max(rates) if rates else None


def decode_speedup(record: dict) -> float | None:
    ours, bf16 = best_rate(record.get("ours", {})), best_rate(record.get("bf16", {}))
    return ours / bf16 if ours and bf16 else None


# ---------------------------------------------------------------- 3. profile

def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("gemv", "gemm", "nvjet", "cutlass", "xmma", "_direct_kernel", "_lut_kernel",
                                   "_lut_build", "lut_gemv", "code2x8", "code1x16", "splitk", "cublas")):
        return "gemv"
    if any(k in lowered for k in ("flash", "fmha", "attention", "sdpa", "efficient")):
        return "attention"
    return "other"


def summarize_kernels(kernels) -> dict:
    """(name, us) per kernel of one step -> counts and microseconds by kind, and the costliest names."""
    kinds: dict[str, dict] = {}
    names: dict[str, dict] = {}
    for name, microseconds in kernels:
        for table, key in ((kinds, kernel_kind(name)), (names, name[:90])):
            entry = table.setdefault(key, {"kernels": 0, "us": 0.0})
            entry["kernels"] += 1
            entry["us"] += microseconds
    total = {"kernels": sum(k["kernels"] for k in kinds.values()), "us": sum(k["us"] for k in kinds.values())}
    top = sorted(names.items(), key=lambda item: -item[1]["us"])[:12]
    return {"by_kind": kinds, "total": total, "top": [{"name": n, **v} for n, v in top]}


def profile_line(profile: dict) -> str:
    return (", ".join(f"{kind} {v['kernels']}x {v['us']:.0f}us" for kind, v in profile["by_kind"].items())
            + f"; total {profile['total']['kernels']} kernels {profile['total']['us']:.0f} us")


def time_head(model) -> dict:
    head = model.get_output_embeddings().weight
    x = torch.randn(1, head.shape[1], device=head.device, dtype=head.dtype)
    seconds = gk.median_seconds(lambda: torch.nn.functional.linear(x, head))
    return {"us": seconds * 1e6, "bytes": head.numel() * head.element_size()}


# ---------------------------------------------------------------- 4. checkpoints

def bench_checkpoint(path: str, args, device, dtype, quantized: bool) -> dict:
    """A real checkpoint: the fp model (fused projections), or the AQLM one through aqlm's kernels and then
    ours (default kernel configurations, untuned); compile+graph where the budget allows."""
    from transformers import AutoModelForCausalLM

    record: dict = {"path": path}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    record["resident_bytes"] = resident_bytes(model)
    cuda = device.type == "cuda"
    mode = "graph" if cuda else "eager"
    compile = cuda and args.compile != "none" and remaining(args) > 60
    if quantized:
        guarded(record, f"aqlm {mode}", decode_run, model, args, device, graphs=cuda)
        from aqflow.inference.layout import from_quantized_linear

        replaced = 0
        for name, module in list(model.named_modules()):
            if type(module).__name__ == "QuantizedLinear":
                parent_name, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(parent_name), attribute,
                        gk.KernelQuantizedLinear(from_quantized_linear(module)))
                replaced += 1
        record["replaced_linears"] = replaced
        record["fused"] = len(fuse_projections(model))
        record["ours_resident_bytes"] = resident_bytes(model)
        guarded(record, f"ours {mode}", decode_run, model, args, device, graphs=cuda)
        if compile:
            guarded(record, "ours compile+graph", decode_run, model, args, device, graphs=True, compile=True)
    else:
        fuse_projections(model)
        guarded(record, f"fp {mode}", decode_run, model, args, device, graphs=cuda)
        if compile:
            guarded(record, "fp compile+graph", decode_run, model, args, device, graphs=True, compile=True)
    del model
    gc.collect()
    return record


# ---------------------------------------------------------------- report

def summary_lines(payload: dict) -> list[str]:
    lines = ["", "=== per linear (1 token): microseconds, in a CUDA graph over weights past the L2 on a GPU "
                 "(ours: best correct configuration) ==="]
    lines.append(f"{'model':5s} {'linear':16s} {'out x in':>13s} {'bf16':>7s} {'ours':>7s} {'x bf16':>6s}  "
                 f"{'config':26s} best per variant")
    for model_name, table in payload.get("kernels", {}).items():
        rows = table.get("linears", {}) if isinstance(table, dict) else {}
        if not isinstance(rows, dict) or "error" in rows or not rows:
            lines.append(f"{model_name:5s} kernels failed or skipped: {str(rows)[:150]}")
            continue
        for name, row in rows.items():
            ours = row.get("ours", {})
            variants = ", ".join(f"{v} {b['us']:.1f}" for v, b in ours.get("best_per_variant", {}).items())
            lines.append(f"{model_name:5s} {name:16s} {row['out']:>6d}x{row['in']:<6d} "
                         f"{row.get('bf16_graph_us', row['bf16_us']):7.1f} "
                         f"{ours.get('us', float('nan')):7.1f} {row.get('speedup_over_bf16', float('nan')):6.2f}  "
                         f"{ours.get('config', ours.get('error', '')):26s} {variants}")
    lines.append("")
    lines.append("=== batch-1 decode, tokens/s ===")
    for model_name, record in payload.get("models", {}).items():
        if "error" in record:
            lines.append(f"{model_name}: FAILED {record['error']}")
            continue
        for kind in ("bf16", "ours", "aqlm"):
            if kind not in record:
                continue
            runs = record[kind]
            cells = [f"{mode} {run['decode_tokens_per_second']:.1f}" for mode, run in runs.items()
                     if isinstance(run, dict) and "decode_tokens_per_second" in run]
            errors = [mode for mode, run in runs.items() if isinstance(run, dict) and "error" in run]
            resident = runs.get("resident_bytes")
            prefill = runs.get("prefill", {}).get("tokens_per_second")
            head = runs.get("head", {}).get("us")
            lines.append(f"{model_name:5s} {kind:5s} " + ", ".join(cells)
                         + (f"; prefill {prefill:.0f}/s" if prefill else "")
                         + (f"; weights {resident / 1e9:.2f} GB" if resident else "")
                         + (f"; head GEMV {head:.0f} us" if head else "")
                         + (f"; FAILED {errors}" if errors else ""))
            for mode, run in runs.items():
                if isinstance(run, dict) and "profile" in run:
                    lines.append(f"{model_name:5s} {kind:5s} {mode} step: {profile_line(run['profile'])}")
        check = record.get("ours", {}).get("logits_check", {})
        if "rel_error" in check:
            lines.append(f"{model_name:5s} ours  logits vs dense weights: rel. error {check['rel_error']:.1e}"
                         + ("" if check["ok"] else " WRONG"))
        lines.append(f"{model_name:5s} speed-up ours / best bf16: {record.get('speedup')}")
    ours_profile = None
    for record in payload.get("models", {}).values():
        for mode in ("compile+graph", "graph"):
            ours_profile = ours_profile or record.get("ours", {}).get(mode, {}).get("profile")
    if ours_profile:
        lines.append("costliest kernels of one step (ours, first model): " + "; ".join(
            f"{t['name'][:50]} {t['kernels']}x {t['us']:.0f}us" for t in ours_profile["top"][:6]))
    for key in ("checkpoint", "fp"):
        if key in payload:
            cells = [f"{mode} {run['decode_tokens_per_second']:.1f}" for mode, run in payload[key].items()
                     if isinstance(run, dict) and "decode_tokens_per_second" in run]
            lines.append(f"{key}: {payload[key].get('path')}: " + ", ".join(cells))
    lines.append(f"CUDA extension: {payload.get('cuda_extension')}")
    for key in ("gpu_decode_speedup_3b", "gpu_decode_speedup_8b"):
        lines.append(f"{key} = {payload.get(key)}")
    lines.append(f"total {elapsed():.0f} s")
    return lines


_SAVE: dict = {}


def save_progress() -> None:
    if "fn" in _SAVE:
        _SAVE["fn"]()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--device-index", type=int, default=0,
                        help="which visible GPU (CUDA_VISIBLE_DEVICES decides which are visible)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of 3B/8B (dry runs)")
    parser.add_argument("--quick", action="store_true", help="no prefill, no compile, 128 new tokens")
    parser.add_argument("--models", default="3b,8b")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--compile", default="all", choices=["none", "3b", "all"],
                        help="which models also decode with torch.compile (both kinds or neither; 8B only if the "
                             "budget still holds two compiles)")
    parser.add_argument("--rtol", type=float, default=1e-2, help="largest relative error a kernel may have")
    parser.add_argument("--checkpoint", help="an AQLM checkpoint directory the pipeline wrote")
    parser.add_argument("--fp", help="the fp model directory of that checkpoint")
    parser.add_argument("--skip-kernels", action="store_true", help="no tuning: default configurations")
    parser.add_argument("--no-cuda-kernels", action="store_true", help="Triton kernels only")
    parser.add_argument("--build-wait-seconds", type=float, default=150,
                        help="the run waits for the CUDA extension build until this many seconds into the run")
    parser.add_argument("--budget-seconds", type=float, default=225,
                        help="optional parts (compile, prefill, aqlm, checkpoints) are skipped past this")
    parser.add_argument("--aqlm", action="store_true", help="also decode through aqlm's kernel (builds at first use)")
    parser.add_argument("--verbose", action="store_true", help="print every candidate configuration's time, the build")
    args = parser.parse_args()
    if args.no_cuda_kernels:
        os.environ["AQFLOW_CUDA_KERNELS"] = "0"
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(args.device_index)
        device = torch.device("cuda", args.device_index)
        torch.set_float32_matmul_precision("high")
    build_thread = cuda_kernels.build_in_background(args.verbose) if device.type == "cuda" and cuda_kernels.enabled() else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # aqlm's CPU kernel takes fp32 only
    models = ["tiny"] if args.tiny else [m.strip() for m in args.models.split(",") if m.strip()]
    if args.tiny:  # the interpreter runs the kernels: a few tokens, no time limits
        args.prompt_tokens, args.new_tokens, args.prefill_tokens = min(args.prompt_tokens, 8), min(args.new_tokens, 6), 16
        args.budget_seconds = float("inf")
    if args.quick:
        args.compile, args.new_tokens = "none", min(args.new_tokens, 128)
    payload: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                     "torch": torch.__version__, "triton": __import__("triton").__version__,
                     "transformers": __import__("transformers").__version__, "aqlm": aqlm_available(),
                     "geometry": GEOMETRY, "args": vars(args), "kernels": {}, "models": {}}
    log(f"device {payload['device']} (index {args.device_index}, CUDA_VISIBLE_DEVICES="
        f"{payload['cuda_visible_devices']}), torch {payload['torch']}, triton {payload['triton']}, "
        f"transformers {payload['transformers']}, aqlm {payload['aqlm']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a run stopped at its time limit still leaves its results
        for name in ("3b", "8b"):
            payload[f"gpu_decode_speedup_{name}"] = payload["models"].get(name, {}).get("speedup")
        payload["cuda_extension"] = cuda_kernels.status()
        payload["tuned_configs"] = {str(k): v.label() for k, v in gk.tuned_configs().items()}
        payload["seconds"] = elapsed()
        (out / "inference_gpu.json").write_text(json.dumps(payload, indent=1, default=str))

    _SAVE["fn"] = save
    for name in models:
        kernels = payload["kernels"].setdefault(name, {})
        guarded(payload["models"], name, bench_model, name, args, device, dtype, kernels, build_thread)
        save()
    if args.checkpoint:
        if remaining(args) > 20:
            guarded(payload, "checkpoint", bench_checkpoint, args.checkpoint, args, device, dtype, True)
        save()
    if args.fp:
        if remaining(args) > 10:
            guarded(payload, "fp", bench_checkpoint, args.fp, args, device, dtype, False)
    save()
    for line in summary_lines(payload):
        print(line)
    print(f"wrote {out / 'inference_gpu.json'}")


if __name__ == "__main__":
    main()
