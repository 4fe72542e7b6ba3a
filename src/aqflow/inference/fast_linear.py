"""`FastQuantizedLinear`: an AQLM linear that stays in its stored form and picks its kernel by
device and token count; `install_fast_linears` puts it in place of aqlm's `QuantizedLinear`.

    CPU,  tokens <= LUT_MAX_TOKENS: cpu_kernels.lut_matmul (lookup tables, the decode path)
    CPU,  more tokens:              cpu_kernels.dequantized_matmul (row chunks through BLAS)
    CUDA, tokens <= GPU_MAX_TOKENS: gpu_kernels.quantized_matmul (Triton, imported when first needed)
    CUDA, more tokens:              the weight dequantized for the call, one cuBLAS matmul

The module's buffers are the codes, codebooks, scales (and bias): no dense weight is kept. Outputs
are in the input's dtype; the CPU kernels compute in float32 whatever the model's dtype.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from aqflow.inference import cpu_kernels
from aqflow.inference.layout import QuantizedWeights, dense_weight, from_quantized_linear

# Tokens up to which the CPU uses lookup tables. Per token the tables cost one indexed load per
# code (~1.7e9/s per core); the dequantized path pays the whole dequantization once per call, then
# BLAS. The crossover measured on SmolLM2's and Llama-3.2-3B's shapes (2x8, benchmarks/inference_cpu.py
# --crossover) lies between 4 and 16 tokens; 8 keeps decoding and short prompts on the tables.
LUT_MAX_TOKENS = 8
# Codebooks up to this many bits use tables on the CPU: a 16-bit codebook has a 256 KiB table
# per code column and token, built from K*g multiply-adds, more work than dequantizing the rows.
LUT_MAX_NBITS = 12
# Tokens up to which CUDA uses the GPU helper's lookup kernel (a matrix-vector kernel per token).
GPU_MAX_TOKENS = 8


class FastQuantizedLinear(nn.Module):
    """y = x W^T + b with W held as AQLM codes. forward(x [..., in]) -> [..., out] in x's dtype.

    On the CPU the codes are held tiled for the CPU kernels (cpu_kernels.tile_codes: the same
    bytes, reordered); on a GPU row-major [out, G, M] as QuantizedWeights has them. A move between
    devices converts them, so there is always one copy."""

    def __init__(self, w: QuantizedWeights):
        super().__init__()
        self.in_features = w.in_features
        self.out_features = w.out_features
        self.nbits = w.nbits
        self.num_codebooks = w.num_codebooks
        self.tiled = w.codes.device.type == "cpu"
        self.register_buffer("codes", cpu_kernels.tile_codes(w.codes, w.nbits) if self.tiled else w.codes)
        self.register_buffer("codebooks", w.codebooks)
        self.register_buffer("scales", w.scales)
        self.register_buffer("bias", w.bias)
        self._cpu_operands: cpu_kernels.CpuOperands | None = None

    @property
    def weights(self) -> QuantizedWeights:
        """The layer as QuantizedWeights (row-major codes: a copy where they are held tiled)."""
        codes = cpu_kernels.untile_codes(self.codes, self.num_codebooks) if self.tiled else self.codes
        return QuantizedWeights(codes=codes, codebooks=self.codebooks, scales=self.scales, bias=self.bias,
                                nbits=self.nbits)

    def quantized_weights(self) -> QuantizedWeights:
        """What decode.fuse_projections packs into one kernel launch on CUDA."""
        return self.weights

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"codebooks={self.num_codebooks}x{self.nbits}bit, group={self.codebooks.shape[-1]}, "
                f"codes {'tiled' if self.tiled else 'row-major'}")

    def _apply(self, fn, recurse=True):
        self._cpu_operands = None  # a move or cast replaces the buffers the operands view
        result = super()._apply(fn, recurse)
        on_cpu = self.codes.device.type == "cpu"
        if on_cpu != self.tiled:  # moved between the CPU and a GPU: the layout of the new device
            self.codes = (cpu_kernels.tile_codes(self.codes, self.nbits) if on_cpu
                          else cpu_kernels.untile_codes(self.codes, self.num_codebooks))
            self.tiled = on_cpu
        return result

    def cpu_operands(self) -> cpu_kernels.CpuOperands:
        if self._cpu_operands is None:
            self._cpu_operands = cpu_kernels.operands_from_tiled(self.codes, self.codebooks, self.scales, self.bias,
                                                                 self.nbits)
        return self._cpu_operands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        tokens = flat.shape[0]
        if flat.device.type == "cpu":
            operands = self._cpu_operands or self.cpu_operands()
            if tokens <= LUT_MAX_TOKENS and self.nbits <= LUT_MAX_NBITS:
                out = cpu_kernels.lut_product(flat, operands)
            else:
                out = cpu_kernels.dequantized_product(flat, operands)
        elif flat.device.type == "cuda" and tokens <= GPU_MAX_TOKENS:
            from aqflow.inference.gpu_kernels import quantized_matmul  # Triton: imported where CUDA runs

            out = quantized_matmul(flat, self.weights)
        else:
            weights = self.weights
            out = nn.functional.linear(flat, dense_weight(weights).to(flat.dtype),
                                       None if weights.bias is None else weights.bias.to(flat.dtype))
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def install_fast_linears(model: nn.Module) -> list[str]:
    """Replace, in place, every aqlm `QuantizedLinear` of `model` by a `FastQuantizedLinear` on the
    same device holding the same codes (unsigned), codebooks, scales and bias. Returns the names
    replaced (empty for a model without AQLM layers). Must run before aqlm's own CPU kernel has
    run on a layer (that kernel transposes the codes in place; such a layer is refused by name)."""
    if importlib.util.find_spec("aqlm") is None:
        return []
    import transformers.quantizers  # noqa: F401  (transformers 5: before aqlm's integration, else a circular import)
    from aqlm import QuantizedLinear

    names = [name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    for name in names:
        try:
            weights = from_quantized_linear(model.get_submodule(name))
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error
        replace_module(model, name, FastQuantizedLinear(weights))
    return names


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in place of `model`'s submodule `name` (a dotted path)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


class CpuBf16Linear(nn.Module):
    """An nn.Linear with a bfloat16 weight whose few-token products on the CPU go through
    cpu_kernels.bf16_matmul (the weight read once as bf16 at close to the memory's bandwidth,
    computed in float32) instead of torch's bf16 GEMV (compute-bound on the 2-core box: ~14 GB/s).
    forward(x [..., in]) -> [..., out] in x's dtype; more tokens, or another device, go to torch.

    It holds the linear's own weight and bias Parameters (tied weights stay tied, no copy)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if (flat.device.type == "cpu" and self.weight.device.type == "cpu" and self.weight.dtype == torch.bfloat16
                and flat.shape[0] <= LUT_MAX_TOKENS):
            out = cpu_kernels.bf16_matmul(flat, self.weight, self.bias)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def install_cpu_bf16_linears(model: nn.Module) -> list[str]:
    """Replace, in place, every nn.Linear of `model` whose weight is bfloat16 on the CPU (the tied
    lm_head of a 2 bpp model, every linear of a bf16 dense one) by a CpuBf16Linear holding the
    same Parameters. Returns the names replaced (empty on a GPU or in another dtype)."""
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"]
    for name in names:
        replace_module(model, name, CpuBf16Linear(model.get_submodule(name)))
    return names
