"""`FastQuantizedLinear`: an AQLM linear that stays in its stored form and picks its kernel by
device and token count; `install_fast_linears` puts it in place of aqlm's `QuantizedLinear`.

    CPU,  tokens <= LUT_MAX_TOKENS: lookup tables, the decode path: register_kernel.product_with_operands
                                    for 8-bit codes where a compiled kernel runs (cpu_dispatch: AVX-512,
                                    AVX2 or NEON), else cpu_kernels.lut_matmul (numba's gathers)
    CPU,  more tokens:              cpu_kernels.dequantized_matmul (row chunks through BLAS)
    CUDA, tokens <= GPU_MAX_TOKENS: gpu_kernels.quantized_matmul (Triton, imported when first needed)
    CUDA, more tokens:              the weight dequantized for the call, one cuBLAS matmul

The module's buffers are the codes, codebooks, scales (and bias): no dense weight is kept. Outputs
are in the input's dtype; the CPU kernels compute in float32 whatever the model's dtype.
`FusedColumnsLinear` makes several of them (q/k/v, gate/up) one compiled-kernel product on a CPU;
`CpuBf16Linear` is the CPU's bf16 GEMV for the linears left dense.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from aqflow.inference import cpu_kernels, register_kernel
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

    The codes are held in the layout of the device's kernels (the same bytes, reordered), named
    by `layout`: on a CPU where a compiled kernel applies the one it reads (register_kernel.kernel_tiles:
    "columns" for avx512, "blocks" for avx2 and neon), "tiles" on other CPUs (cpu_kernels.tile_codes),
    "rows" on a GPU (row-major [out, G, M] as QuantizedWeights has them). A move between devices
    converts them, so there is always one copy."""

    open_sums = None  # an open_sums.OpenSumsSite inside open_sums_enabled: one token on CUDA with open sums

    def __init__(self, w: QuantizedWeights):
        super().__init__()
        self.in_features = w.in_features
        self.out_features = w.out_features
        self.nbits = w.nbits
        self.num_codebooks = w.num_codebooks
        self.layout = self.device_layout(w.codes)
        self.register_buffer("codes", self.to_layout(w.codes, self.layout))
        self.register_buffer("codebooks", w.codebooks)
        self.register_buffer("scales", w.scales)
        self.register_buffer("bias", w.bias)
        self._cpu_operands: cpu_kernels.CpuOperands | None = None
        self._register_operands: register_kernel.RegisterOperands | None = None

    def device_layout(self, codes: torch.Tensor) -> str:
        """The layout `codes` (in any layout) are held in on their device."""
        if codes.device.type != "cpu":
            return "rows"
        byte_codes = codes.dtype == torch.uint8  # the compiled kernels read one byte a code
        if byte_codes and register_kernel.applies(self.nbits, self.out_features):
            return register_kernel.kernel_layout()
        return "tiles"

    def to_layout(self, row_codes: torch.Tensor, layout: str) -> torch.Tensor:
        """Row-major codes [out, G, M] -> the codes as `layout` holds them."""
        if layout in register_kernel.LAYOUTS:
            return register_kernel.kernel_tiles(row_codes, layout)
        return cpu_kernels.tile_codes(row_codes, self.nbits) if layout == "tiles" else row_codes

    def row_codes(self) -> torch.Tensor:
        """The codes row-major [out, G, M] (a copy unless they are held so)."""
        if self.layout in register_kernel.LAYOUTS:
            return register_kernel.rows_from_kernel_tiles(self.codes, self.num_codebooks, self.layout)
        return cpu_kernels.untile_codes(self.codes, self.num_codebooks) if self.layout == "tiles" else self.codes

    @property
    def weights(self) -> QuantizedWeights:
        """The layer as QuantizedWeights (row-major codes: a copy where they are held otherwise)."""
        return QuantizedWeights(codes=self.row_codes(), codebooks=self.codebooks, scales=self.scales, bias=self.bias,
                                nbits=self.nbits)

    def quantized_weights(self) -> QuantizedWeights:
        """What decode.fuse_projections packs into one kernel launch on CUDA."""
        return self.weights

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"codebooks={self.num_codebooks}x{self.nbits}bit, group={self.codebooks.shape[-1]}, "
                f"codes as {self.layout}")

    def _apply(self, fn, recurse=True):
        self._cpu_operands = self._register_operands = None  # a move or cast replaces the buffers they view
        result = super()._apply(fn, recurse)
        layout = self.device_layout(self.codes)
        if layout != self.layout:  # moved between the CPU and a GPU: the layout of the new device
            self.codes = self.to_layout(self.row_codes(), layout)
            self.layout = layout
        return result

    def cpu_operands(self) -> cpu_kernels.CpuOperands:
        """The numba kernels' view of the layer (codes tiled; a tiled copy where they are held as columns)."""
        if self._cpu_operands is None:
            tiled = self.codes if self.layout == "tiles" else cpu_kernels.tile_codes(self.row_codes(), self.nbits)
            self._cpu_operands = cpu_kernels.operands_from_tiled(tiled, self.codebooks, self.scales, self.bias,
                                                                 self.nbits)
        return self._cpu_operands

    def register_operands(self) -> register_kernel.RegisterOperands:
        """The compiled kernel's view of the layer (the column tiles shared; codebooks, scales and
        bias as float32 copies, made once rather than on every token)."""
        if self._register_operands is None:
            self._register_operands = register_kernel.register_operands(self.codes, self.codebooks, self.scales,
                                                                        self.bias, self.layout)
        return self._register_operands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        tokens = flat.shape[0]
        compiled = self.layout in register_kernel.LAYOUTS
        if flat.device.type == "cpu" and compiled and tokens <= LUT_MAX_TOKENS:
            out = register_kernel.product_with_operands(flat, self._register_operands or self.register_operands())
        elif flat.device.type == "cpu" and compiled:
            # prefill: the dequantized path on a tiled copy of the codes, made for the call
            out = cpu_kernels.dequantized_matmul(flat, self.weights)
        elif flat.device.type == "cpu":
            operands = self._cpu_operands or self.cpu_operands()
            if tokens <= LUT_MAX_TOKENS and self.nbits <= LUT_MAX_NBITS:
                out = cpu_kernels.lut_product(flat, operands)
            else:
                out = cpu_kernels.dequantized_product(flat, operands)
        elif self.open_sums is not None:  # set on CUDA layers only (open_sums_enabled)
            return self.open_sums(x)
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


class FusedColumnsLinear(nn.Module):
    """Several FastQuantizedLinear of the same input held for a compiled kernel on a CPU (q/k/v, gate/up)
    as one product: forward(x [..., in]) -> [..., sum(out)] in x's dtype. A decode step's few tokens
    take one compiled-kernel call for all (register_kernel.stacked_operands: two parallel regions and
    one Python call instead of those of each layer); more tokens go through each layer's own forward.

    The layers' codes are moved into one stacked tensor and each layer's `codes` buffer becomes its
    view of it, so the codes are held once. The layers stay submodules (`layers`)."""

    def __init__(self, layers: list[FastQuantizedLinear]):
        super().__init__()
        if not fused_columns_fit(layers):
            raise ValueError("FusedColumnsLinear: the layers must be FastQuantizedLinear held for one compiled "
                             "kernel on a CPU, with one input size and one codebook shape")
        self.layers = nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.out_features = sum(layer.out_features for layer in layers)
        stacked = torch.cat([layer.codes for layer in layers])
        start = 0
        for layer in layers:
            count = layer.codes.shape[0]
            layer.codes = stacked[start:start + count]  # the buffer is now a view: one copy of the codes
            layer._register_operands = None
            start += count
        self._stacked_codes = stacked
        self._operands: register_kernel.RegisterOperands | None = None

    def _apply(self, fn, recurse=True):
        self._operands = None  # the layers' buffers are replaced: they are no longer views of the stack
        self._stacked_codes = None
        return super()._apply(fn, recurse)

    def operands(self) -> register_kernel.RegisterOperands | None:
        """The stacked operands, or None once the layers were moved or cast (then each runs alone)."""
        if self._operands is None and self._stacked_codes is not None:
            self._operands = register_kernel.stacked_operands(
                self._stacked_codes, [layer.register_operands() for layer in self.layers])
        return self._operands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        operands = self.operands() if flat.device.type == "cpu" and flat.shape[0] <= LUT_MAX_TOKENS else None
        if operands is None:
            return torch.cat([layer(x) for layer in self.layers], dim=-1)
        out = register_kernel.product_with_operands(flat, operands)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def fused_columns_fit(layers) -> bool:
    """Whether FusedColumnsLinear takes these modules: FastQuantizedLinear with codes in a compiled
    kernel's layout (one for all) on a CPU, one input size, one codebook shape (codebooks, group)."""
    return (len(layers) > 0 and all(type(layer) is FastQuantizedLinear and layer.layout in register_kernel.LAYOUTS
                                    and layer.codes.device.type == "cpu" for layer in layers)
            and len({layer.layout for layer in layers}) == 1
            and len({layer.in_features for layer in layers}) == 1
            and len({tuple(layer.codebooks.shape) for layer in layers}) == 1)


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
