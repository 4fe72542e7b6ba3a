"""Open sums: a CUDA decode step whose 2-bit GEMVs leave their finishing to the kernel that reads their output.

Why: the split-K GEMV (csrc/lut_gemv.cu) splits a row's input groups between CTAs, which add their sums into
an fp32 workspace; the last CTA of each row block to arrive then applies scales and bias and writes the
output. That finishing is a fence, an atomic and a second pass in series at the end of every launch:
~0.27 ms of a 1.70 ms Llama-3.2-3B decode step on an H200 (`benchmarks/epilogue_floor.sh`). With open sums
the kernel only adds its sums into a zeroed fp32 buffer of the layer's own, and torch computes
`sums * scales + bias` and the cast; torch.compile folds those into the kernel that reads the output next
(the RMSNorm, the rotary embedding, silu(gate) * up). The buffers are zeroed together, once a step, by
one kernel.

- `open_sums_enabled(model)`: a context in which every CUDA 2x8 linear whose configuration for one token is
  the split-K kernel (FusedQuantizedLinear, FastQuantizedLinear, KernelQuantizedLinear: modules with an
  `open_sums` attribute) computes one token this way; it yields a `StepSums` whose `zero()` the decode
  step calls after each step (and which is captured with it in a CUDA graph). Restored after.
- Only for a decode step that zeroes the buffers after every forward (greedy_decode's `_DecodeStep`): a
  forward called twice without `zero()` in between adds into the sums of the first.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


class OpenSumsSite(torch.nn.Module):
    """One linear's product while open sums are on: its packed weights, its kernel configuration (one token)
    and its sums buffer [1, rows] fp32, zero between steps. One token goes through open sums, more through
    the linear's usual product (gpu_kernels.packed_matmul)."""

    def __init__(self, packed, config: list[int]):
        super().__init__()
        from aqflow.inference import gpu_kernels  # Triton: imported where CUDA runs

        self._kernels = gpu_kernels
        self.packed = packed
        self.config = list(config)
        self.register_buffer("sums", torch.zeros(1, packed.rows, dtype=torch.float32, device=packed.codes.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return self._kernels.packed_matmul(x, self.packed)
        return self._kernels.open_packed_matmul(x, self.packed, self.config, self.sums)

    def unfinished(self, x: torch.Tensor) -> torch.Tensor:
        """One token x [..., in] -> its sums [1, rows] fp32, unscaled (a reader finishes them: cuda_layers)."""
        return self._kernels.open_packed_sums(x, self.packed, self.config, self.sums)


@dataclass
class StepSums:
    """The sums buffers of a model's open-sums sites; zero() resets them all in one kernel."""

    buffers: list[torch.Tensor]

    def zero(self) -> None:
        if self.buffers:
            torch._foreach_zero_(self.buffers)


def site_for(module: torch.nn.Module) -> OpenSumsSite | None:
    """The open-sums site of a 2-bit linear whose one-token configuration is the split-K CUDA kernel, else None."""
    from aqflow.inference import cuda_kernels, gpu_kernels
    from aqflow.inference.packed import as_packed

    packed = getattr(module, "packed", None)
    if packed is None:
        weights = module.quantized_weights()
        if not weights.codes.is_cuda:
            return None
        packed = as_packed(weights)
    if not (packed.codes.is_cuda and cuda_kernels.applies(packed, 1)):
        return None
    config = gpu_kernels.config_for(packed, 1)
    if config.variant not in cuda_kernels.SPLIT_K_VARIANTS:
        return None
    return OpenSumsSite(packed, config.as_list())


def open_sums_sites(model: torch.nn.Module) -> list[tuple[torch.nn.Module, OpenSumsSite]]:
    """(module, its site) for every module of `model` that takes open sums (an `open_sums` attribute) and
    runs the split-K CUDA kernel for one token."""
    sites = []
    for module in model.modules():
        if hasattr(type(module), "open_sums") and (site := site_for(module)) is not None:
            sites.append((module, site))
    return sites


@contextlib.contextmanager
def open_sums_enabled(model: torch.nn.Module, enabled: bool = True) -> Iterator[StepSums | None]:
    """Within the block the model's eligible linears compute one token with open sums; yields the StepSums
    to zero after each step (None when not enabled; an empty one when no linear is eligible)."""
    if not enabled:
        yield None
        return
    sites = open_sums_sites(model)
    for module, site in sites:
        # in the instance's __dict__, past nn.Module's registration: a registered submodule would not shadow the
        # class attribute (None) that the forward reads
        module.__dict__["open_sums"] = site
    try:
        yield StepSums([site.sums for _, site in sites])
    finally:
        for module, _ in sites:
            del module.__dict__["open_sums"]  # the class attribute (None) again
