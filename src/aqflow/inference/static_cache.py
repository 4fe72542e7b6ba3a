"""The layer of a transformers static KV cache that a one-token attention forward writes into and reads.

`static_layer(cache, index, dtype)` gives layer `index` of `cache` when it is a filled static layer whose
keys/values are [1, Hkv, L, D] dense tensors of `dtype` with a `cumulative_length` tensor (the positions
written so far): what `cpu_layers` and `cuda_layers` need to write the new key and value themselves.
Anything else (no cache, a dynamic or sliding cache, a layer not yet filled): None, and the caller falls
back to the module's own forward.
"""

from __future__ import annotations

import torch


def static_layer(cache, layer_index: int, dtype: torch.dtype):
    """The cache's layer `layer_index` if it is a filled static layer of `dtype` (keys/values [1, Hkv, L,
    D], contiguous, and a cumulative_length tensor), else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_index >= len(layers):
        return None
    layer = layers[layer_index]
    if type(layer).__name__ != "StaticLayer" or not getattr(layer, "is_initialized", False) \
            or not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        return None
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if keys is None or values is None or keys.dtype != dtype or values.dtype != dtype or keys.shape[0] != 1:
        return None
    if not (keys.is_contiguous() and values.is_contiguous()):
        return None
    return layer
