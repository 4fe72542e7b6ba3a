"""One AQLM linear in the form the decode kernels read: codes, codebooks, scales, nothing dense.

The checkpoint stores (as the `aqlm` package does) codes [out, G, M] in signed int8/int16, codebooks
[M, K, 1, g] and scales [out, 1, 1, 1]; `QuantizedWeights` holds the same numbers with the codes
unsigned (so a kernel can index a codebook with them directly) and the singleton axes dropped.
The weight they stand for, for every input group j of g weights:

    W[o, j*g:(j+1)*g] = scales[o] * sum_m codebooks[m, codes[o, j, m], :]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aqflow.quant.representation import dequantize_weight, unpack_codes


@dataclass(frozen=True)
class QuantizedWeights:
    """codes [out, G, M] uint8 (nbits <= 8) or int32 (9..16 bits), values in [0, K), contiguous;
    codebooks [M, K, g] and scales [out] in the model's dtype; bias [out] or None.
    in_features = G * g. All on one device."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    nbits: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def group_size(self) -> int:
        return self.codebooks.shape[-1]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * self.group_size

    @property
    def num_codebooks(self) -> int:
        return self.codes.shape[2]

    def stored_bytes(self) -> int:
        """Bytes of the tensors as held (codes at their container width, not at nbits)."""
        tensors = [self.codes, self.codebooks, self.scales] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def code_container(nbits: int) -> torch.dtype:
    """The unsigned-valued dtype codes of `nbits` bits are held in: uint8 up to 8 bits, else int32."""
    if not 1 <= nbits <= 16:
        raise ValueError(f"nbits={nbits}: the AQLM format stores 1..16-bit codes")
    return torch.uint8 if nbits <= 8 else torch.int32


def from_aqlm_tensors(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None, nbits: int) -> QuantizedWeights:
    """From the tensors of an `aqlm.QuantizedLinear` (or a checkpoint): codes [out, G, M] signed as
    stored, codebooks [M, K, 1, g], scales [out, 1, 1, 1]. Only out_group_size 1 (what aqflow writes)."""
    if codebooks.dim() != 4 or codebooks.shape[2] != 1:
        raise ValueError(f"codebooks {tuple(codebooks.shape)}: expected [M, K, 1, g] (out_group_size 1)")
    unsigned = unpack_codes(codes, nbits).to(code_container(nbits)).contiguous()
    return QuantizedWeights(codes=unsigned, codebooks=codebooks[:, :, 0, :].contiguous(),
                            scales=scales.reshape(-1).contiguous(),
                            bias=None if bias is None else bias.contiguous(), nbits=nbits)


def from_quantized_linear(layer: torch.nn.Module) -> QuantizedWeights:
    """From an `aqlm.QuantizedLinear` as transformers + aqlm load an aqflow checkpoint."""
    if layer.out_group_size != 1:
        raise ValueError(f"out_group_size {layer.out_group_size}: only 1 is supported (what aqflow writes)")
    if layer.codes.shape[0] != layer.out_features:
        # aqlm's CPU kernel transposes a layer's codes in place on its first call
        raise ValueError("from_quantized_linear: this QuantizedLinear has already run aqlm's CPU kernel (codes transposed)")
    return from_aqlm_tensors(layer.codes.data, layer.codebooks.data, layer.scales.data,
                             None if layer.bias is None else layer.bias.data, layer.nbits_per_codebook)


def dense_weight(weights: QuantizedWeights) -> torch.Tensor:
    """The weight [out, in] the codes stand for, in the codebooks' dtype: the reference every kernel
    is checked against."""
    return dequantize_weight(weights.codes.to(torch.int64), weights.codebooks, weights.scales)


def reference_linear(x: torch.Tensor, weights: QuantizedWeights) -> torch.Tensor:
    """x [..., in] -> [..., out] through the dense weight (the reference, not a fast path)."""
    return torch.nn.functional.linear(x, dense_weight(weights).to(x.dtype),
                                      None if weights.bias is None else weights.bias.to(x.dtype))
