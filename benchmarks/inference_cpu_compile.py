"""Does torch.compile take the per-op overhead out of a CPU decode step? A probe, not a path of aqflow.

    PYTHONPATH=src:. python3 benchmarks/inference_cpu_compile.py --shape smollm2 --dtype float32 --mode eager
    PYTHONPATH=src:. python3 benchmarks/inference_cpu_compile.py --shape smollm2 --dtype float32 --mode compile

A random 2x8 model of the shape (benchmarks/inference_cpu.py's random_llama, FastQuantizedLinear
layers) decodes greedily (aqflow.inference.decode.greedy_decode, static cache, no graphs) in this
process, on --threads threads. torch.compile cannot trace the numba kernels (they read the
buffers as numpy arrays), so in modes `op` and `compile` each layer's product goes through an
operator registered here (opaque to the compiler; its fake gives the output's shape); `op` runs
it eagerly (the operator's own dispatch cost), `compile` compiles the step around it. Prints the
tokens of eager and of the mode (the same, or it says so) and the best decode tokens/s of three runs.
"""

from __future__ import annotations

import argparse
import time

import numba
import torch

from aqflow.inference import cpu_kernels, fast_linear
from aqflow.inference.decode import greedy_decode
from benchmarks.inference_cpu import LLAMA_3B, SMOLLM2, random_llama

OPERANDS: list[cpu_kernels.CpuOperands] = []  # the layers' kernel operands, by the index the operator takes
LIBRARY = torch.library.Library("aqflow_probe", "DEF")
LIBRARY.define("lut(Tensor x, int layer) -> Tensor")


def _lut(x: torch.Tensor, layer: int) -> torch.Tensor:
    return cpu_kernels.lut_product(x, OPERANDS[layer])


LIBRARY.impl("lut", _lut, "CPU")


@torch.library.register_fake("aqflow_probe::lut")
def _lut_shape(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], OPERANDS[layer].out_features), dtype=torch.float32)


def forward_through_operator(self: fast_linear.FastQuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """FastQuantizedLinear.forward with the table product as the operator above (decode: few tokens)."""
    if not hasattr(self, "probe_index"):
        OPERANDS.append(self.cpu_operands())
        self.probe_index = len(OPERANDS) - 1
    out = torch.ops.aqflow_probe.lut.default(x.reshape(-1, self.in_features), self.probe_index)
    return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("smollm2", "llama3b"), default="smollm2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the unquantized parts")
    parser.add_argument("--mode", choices=("eager", "op", "compile"), default="compile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 48 (smollm2), 6 (llama3b)")
    args = parser.parse_args()

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    shape = SMOLLM2 if args.shape == "smollm2" else LLAMA_3B
    model = random_llama(shape, getattr(torch, args.dtype), "fast")
    prompt = torch.randint(0, shape["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    eager_tokens, _ = greedy_decode(model, prompt, 8, compile=False, graphs=False)
    if args.mode != "eager":
        fast_linear.FastQuantizedLinear.forward = forward_through_operator
    settings = dict(compile=args.mode == "compile", graphs=False)
    started = time.perf_counter()
    tokens, timings = greedy_decode(model, prompt, 8, **settings)
    print(f"first call (compiles in mode compile) {time.perf_counter() - started:.1f} s, mode {timings.mode}, "
          f"compile error {timings.compile_error}, tokens as eager: {torch.equal(tokens, eager_tokens)}")
    new_tokens = args.new_tokens or (48 if args.shape == "smollm2" else 6)
    best = max(greedy_decode(model, prompt, new_tokens, **settings)[1].decode_tokens_per_second for _ in range(3))
    print(f"{args.shape} {args.dtype} rest, {args.mode}, {args.threads} threads: {best:.2f} tokens/s (best of 3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
