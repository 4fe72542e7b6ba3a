"""A small AQLM checkpoint in the layout the pipeline writes, from a tiny fp model folder, for the
inference tests (random codes: what is tested is that every path computes the same function)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from aqflow.quant.representation import dequantize_weight, pack_codes


def write_random_aqlm_checkpoint(fp_dir: Path, out_dir: Path, num_codebooks: int = 2, nbits: int = 8,
                                 group_size: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every decoder linear of fp_dir's model replaced by random codes (num_codebooks codebooks of
    2^nbits codewords over groups of group_size), codebooks and scales in the weights' dtype.
    Writes out_dir (weights, config with its quantization_config, tokenizer); returns
    {linear name: dequantized weight [out, in] float32}."""
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(fp_dir / "model.safetensors"))
    linears = sorted(name[: -len(".weight")] for name, t in tensors.items() if name.startswith("model.layers.") and t.dim() == 2)
    weights = {}
    for name in linears:
        weight = tensors.pop(f"{name}.weight")
        out_features, in_features = weight.shape
        codes = torch.randint(0, 1 << nbits, (out_features, in_features // group_size, num_codebooks), generator=generator)
        codebooks = (torch.randn(num_codebooks, 1 << nbits, 1, group_size, generator=generator) * 0.05).to(weight.dtype)
        scales = (1 + torch.rand(out_features, 1, 1, 1, generator=generator)).to(weight.dtype)
        tensors.update({f"{name}.codes": pack_codes(codes, nbits), f"{name}.codebooks": codebooks, f"{name}.scales": scales})
        weights[name] = dequantize_weight(codes, codebooks.float(), scales.float())
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp_dir / "config.json").read_text())
    keep = sorted({n.rsplit(".", 1)[0] for n in tensors if not n.endswith((".codes", ".codebooks", ".scales"))} | {"lm_head"})
    config["quantization_config"] = {"quant_method": "aqlm", "in_group_size": group_size, "out_group_size": 1,
                                     "num_codebooks": num_codebooks, "nbits_per_codebook": nbits,
                                     "linear_weights_not_to_quantize": keep + [f"{k}.weight" for k in keep]}
    (out_dir / "config.json").write_text(json.dumps(config))
    for item in fp_dir.iterdir():
        if item.name.startswith("tokenizer") or item.name in ("special_tokens_map.json", "generation_config.json"):
            (out_dir / item.name).write_bytes(item.read_bytes())
    return weights
