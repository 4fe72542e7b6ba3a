"""AQLM layers as plain dense linears, for evaluating an AQLM checkpoint.

aqlm's CPU kernel for 8-bit codebooks (numba, a lookup table per call) runs on one thread only
(it gives wrong outputs with more) and is 5-14x slower than a dense matmul of the same shape on one
thread (benchmarks/aqlm_cpu_kernel.py, in the git history), so a CPU evaluation of SmolLM2 through it is very slow.
On a GPU, aqlm's 2x8 kernel runs one matrix-vector product per input row: made for decoding one
token at a time, not for lm-eval's batches of thousands of tokens.
The checkpoint is still loaded by transformers + aqlm (the format is what is evaluated); each
`QuantizedLinear` is then replaced once by an `nn.Linear` holding the weight that aqlm's own
dequantization gives, which is the same function of the inputs up to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The weight an aqlm `QuantizedLinear` represents, by aqlm's own dequantization.

    layer.codes [out/out_group, in/in_group, M] int8 or int16 (packed: signed, as aqlm stores
    them), codebooks [M, K, out_group, in_group] floating, scales [out/out_group, 1, 1, 1] floating
    -> weight [out, in] in the codebooks' dtype, on their device
    """
    from aqlm.utils import _dequantize_weight, unpack_int_data

    if layer.codes.shape[0] != layer.out_features // layer.out_group_size:
        # aqlm's CPU kernel transposes the codes in place on its first call
        raise ValueError("dense_weight: this QuantizedLinear has already run aqlm's CPU kernel (codes transposed)")
    # codes are stored in signed ints of nbits (an 8-bit code 200 reads as -56): unpack as aqlm does
    codes = unpack_int_data(layer.codes, layer.nbits_per_codebook)
    return _dequantize_weight(codes, layer.codebooks, layer.scales)


def dequantize_aqlm_linears(model: nn.Module) -> list[str]:
    """Replace, in place, every aqlm `QuantizedLinear` of `model` by an equal `nn.Linear`.

    Each new linear holds weight [out, in] (and bias [out]) in the codebooks' dtype and device.
    Returns the replaced module names (empty for a model without AQLM layers)."""
    from aqlm import QuantizedLinear

    names = [name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    for name in names:
        layer = model.get_submodule(name)
        with torch.no_grad():
            weight = dense_weight(layer)
            dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                              device=weight.device, dtype=weight.dtype)
            dense.weight.copy_(weight)
            if layer.bias is not None:
                dense.bias.copy_(layer.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
    return names
