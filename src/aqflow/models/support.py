"""Which models the pipeline can quantize, decided before any job runs.

The pipeline needs a decoder-only causal LM (AutoModelForCausalLM) whose decoder blocks compute
with `nn.Linear` layers (the calibration hooks and the AQLM checkpoint replace exactly those)
and whose every such linear has `in_features` divisible by the quantization group size (a code
covers `group_size` consecutive input weights). Two levels of checking:

- `config_problems(config)`: config.json alone (no torch), cheap enough for Snakemake's DAG build;
- `model_problems(config)`: the model built on the meta device (no memory), every block linear
  checked; run by fetch_model before anything is written.
"""

from __future__ import annotations

from typing import Mapping

# model types whose decoder projections are transformers' Conv1D (weights stored transposed),
# which neither the calibration hooks nor aqlm's QuantizedLinear handle
CONV1D_MODEL_TYPES = {"gpt2", "gpt_bigcode", "openai-gpt", "imagegpt", "decision_transformer"}


class UnsupportedModelError(ValueError):
    """A model this pipeline cannot quantize; the message names it and the reason."""


def _dimension_problems(config: Mapping, group_size: int) -> list[str]:
    sizes = {key: config[key] for key in ("hidden_size", "intermediate_size")
             if isinstance(config.get(key), int)}
    return [f"{key} {value} is not divisible by the quantization group size {group_size}"
            for key, value in sizes.items() if value % group_size]


def config_problems(config: Mapping, group_size: int) -> list[str]:
    """Reasons (possibly none) read from config.json alone why a model cannot be quantized."""
    problems = []
    if config.get("is_encoder_decoder"):
        problems.append(f"it is an encoder-decoder model ({config.get('model_type')}); only decoder-only causal LMs are supported")
    architectures = config.get("architectures") or []
    if architectures and not any(name.endswith("ForCausalLM") or name.endswith("LMHeadModel") for name in architectures):
        problems.append(f"its architectures {architectures} include no causal LM (…ForCausalLM)")
    if config.get("model_type") in CONV1D_MODEL_TYPES:
        problems.append(f"model_type {config['model_type']!r} computes with Conv1D projections, not nn.Linear")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        problems.append(f"it is already quantized ({method}); give the full-precision model")
    text_config = config.get("text_config")
    problems += _dimension_problems(text_config if isinstance(text_config, Mapping) else config, group_size)
    return problems


def model_problems(config: Mapping, group_size: int) -> list[str]:
    """config_problems, then the model built on the meta device: every linear of its decoder blocks
    must be an nn.Linear with in_features divisible by `group_size`."""
    problems = config_problems(config, group_size)
    if problems:
        return problems
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from .structure import find_decoder_blocks

    try:
        settings = {key: value for key, value in config.items() if key != "model_type"}
        hf_config = AutoConfig.for_model(config.get("model_type"), **settings)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, ImportError) as error:
        return [f"transformers cannot build it as a causal LM ({str(error).splitlines()[0]})"]
    if any(isinstance(module, Conv1D) for module in model.modules()):
        return ["it computes with Conv1D projections, not nn.Linear"]
    try:
        _, blocks = find_decoder_blocks(model)
    except ValueError as error:
        return [str(error)]
    bad = {name: module.in_features for name, module in blocks[0].named_modules()
           if isinstance(module, nn.Linear) and module.in_features % group_size}
    if bad:
        problems.append(f"block linears whose in_features is not divisible by the group size {group_size}: {bad}")
    return problems


def refuse_unsupported(name: str, problems: list[str]) -> None:
    """Raise UnsupportedModelError naming model `name` and every problem (if any)."""
    if problems:
        raise UnsupportedModelError(f"model {name!r} cannot be quantized by this pipeline: " + "; ".join(problems))
