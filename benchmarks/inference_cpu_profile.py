"""Where one CPU decode step of the Llama-3.2-3B-shaped 2x8 model goes: wall time per kind of module.

    PYTHONPATH=src .venv/bin/python benchmarks/inference_cpu_profile.py [--threads 2] [--steps 4] [--dtype bfloat16]

Builds benchmarks/inference_cpu.py's random model (2x8 FastQuantizedLinear, unquantized parts in
--dtype; bf16 linears through numba's GEMV as runtime's CPU fast path has them, unless --torch-bf16;
the new token's attention and the layers' small operations as greedy_decode runs them on a CPU,
cpu_attention and cpu_layers, unless --stock), decodes a warm-up, then times --steps single-token steps
with forward pre/post hooks on every module: each kind's time is its own (exclusive: the time of hooked
children inside it is subtracted), so the kinds add up to the hooked total; "outside modules" is the
step's wall time left (the decode loop's argmax, cache bookkeeping, transformers' mask and cache code
outside the hooked modules). The hooks cost a few microseconds per module call (~700 per step), charged
to the parent's time, so small modules look dearer than they are (on the 2-core box torch's RMSNorm
takes ~19 us a call unhooked and ~60 hooked): benchmarks/cpu_layers_step.py times whole steps.
Prints ms per step per kind, with the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch


def kind_of(name: str, module: torch.nn.Module) -> str:
    """A readable kind for a module: the projection name for linears, the class name otherwise."""
    leaf = name.rpartition(".")[2]
    if leaf == "fused":  # the one product of q/k/v or gate/up (decode.fuse_projections), held by q_proj or gate_proj
        return f"{name.rpartition('.')[0].rpartition('.')[2]} fused ({type(module).__name__})"
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        return f"{leaf} ({type(module).__name__})"
    return type(module).__name__


def hook_exclusive_times(model: torch.nn.Module) -> tuple[dict, list]:
    """Forward hooks that add each module call's exclusive wall seconds into times[kind]; returns
    (times, handles)."""
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    stack: list[list[float]] = []  # [start, seconds of hooked children]

    def pre(module, args, kind):
        stack.append([time.perf_counter(), 0.0])

    def post(module, args, output, kind):
        start, children = stack.pop()
        spent = time.perf_counter() - start
        times[kind] += spent - children
        calls[kind] += 1
        if stack:
            stack[-1][1] += spent

    handles = []
    for name, module in model.named_modules():
        if module is model:
            continue
        kind = kind_of(name, module)
        handles.append(module.register_forward_pre_hook(lambda m, a, k=kind: pre(m, a, k)))
        handles.append(module.register_forward_hook(lambda m, a, o, k=kind: post(m, a, o, k)))
    times["_calls"] = calls  # type: ignore[assignment]
    return times, handles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's intra-op threads (default: --threads; numba's are --threads)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--linears", default="fast", choices=("fast", "dense"))
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--torch-bf16", action="store_true",
                        help="leave bf16 nn.Linears (the lm_head) to torch instead of numba's GEMV (the fast path's)")
    parser.add_argument("--stock", action="store_true",
                        help="attention through SDPA and the modules' own forwards (greedy_decode's default on a CPU: "
                             "cpu_attention and cpu_layers)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="q/k/v and gate/up as separate products (greedy_decode fuses them by default)")
    args = parser.parse_args()

    import numba

    from aqflow.inference.decode import fuse_projections, new_static_cache, step_logits
    from aqflow.inference.fast_linear import install_cpu_bf16_linears
    from benchmarks.inference_cpu import LLAMA_3B, random_llama

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.torch_threads or args.threads)
    print(f"numba threading layer {numba.threading_layer() if hasattr(numba, 'threading_layer') else '?'}; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    print(f"load average at start {os.getloadavg()}", flush=True)
    started = time.perf_counter()
    model = random_llama(LLAMA_3B, getattr(torch, args.dtype), args.linears)
    if not args.torch_bf16:
        install_cpu_bf16_linears(model)
    if not args.no_fuse:
        fuse_projections(model)
    print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    prompt = torch.randint(0, LLAMA_3B["vocab_size"], (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    from aqflow.inference.decode import one_token_paths

    paths = one_token_paths(model, fast_attention=False) if args.stock else one_token_paths(model)
    with torch.inference_mode(), paths as (attention, switched):
        print(f"attention {attention or 'SDPA'}, {switched} modules through cpu_layers", flush=True)
        cache = new_static_cache(model, args.prompt_tokens + 2 * args.steps + 4)
        model(input_ids=prompt, position_ids=torch.arange(args.prompt_tokens)[None], past_key_values=cache,
              use_cache=True, logits_to_keep=1)
        token = prompt[:, -1:].clone()
        position = args.prompt_tokens
        for _ in range(2):  # warm-up steps: numba's kernels loaded, caches touched
            token = step_logits(model, cache, token, torch.tensor([[position]])).argmax(-1, keepdim=True)
            position += 1
        plain = []
        for _ in range(args.steps):
            begin = time.perf_counter()
            token = step_logits(model, cache, token, torch.tensor([[position]])).argmax(-1, keepdim=True)
            plain.append(time.perf_counter() - begin)
            position += 1
        times, handles = hook_exclusive_times(model)
        walls = []
        for _ in range(args.steps):
            begin = time.perf_counter()
            token = step_logits(model, cache, token, torch.tensor([[position]])).argmax(-1, keepdim=True)
            walls.append(time.perf_counter() - begin)
            position += 1
        for handle in handles:
            handle.remove()
    calls = times.pop("_calls")
    steps = args.steps
    wall = sum(walls) / steps
    hooked = sum(times.values()) / steps
    print(f"threads {args.threads}, {args.linears} linears, {args.dtype} rest; load average at end {os.getloadavg()}")
    print(f"step without hooks: mean {sum(plain) / steps * 1e3:.1f} ms, min {min(plain) * 1e3:.1f} ms; "
          f"with hooks: mean {wall * 1e3:.1f} ms")
    for kind, seconds in sorted(times.items(), key=lambda item: -item[1]):
        print(f"  {kind:40s} {seconds / steps * 1e3:8.2f} ms  {calls[kind] // steps:4d} calls")
    print(f"  {'outside modules':40s} {(wall - hooked) * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
