"""The quantizer core: AQLM-format additive quantization with greedy and OA-EM initialisation."""

from aqflow.quant.quantize import QuantizedLayer, QuantizerSettings, quantize_layer
from aqflow.quant.representation import dequantize_weight, layer_rho, model_rho

__all__ = [
    "QuantizedLayer",
    "QuantizerSettings",
    "quantize_layer",
    "dequantize_weight",
    "layer_rho",
    "model_rho",
]
