"""Per-layer AQLM results -> one standard AQLM Hugging Face checkpoint, and back.

Every linear of every decoder block is quantized by its own job, which leaves one file per
linear under `layers_dir` (see `layer_artifact_path`):

    codes      [out, in/g, M]   int8 (nbits <= 8) or int16, packed as the `aqlm` package stores them
    codebooks  [M, K, 1, g]     float32, K = 2^nbits
    scales     [out, 1, 1, 1]   float32

`write_aqlm_checkpoint` joins them with the untouched rest of the full-precision model into the
folder `transformers` + `aqlm` load with `from_pretrained`: config.json carries
`quantization_config = {"quant_method": "aqlm", ...}` and the weights of each quantized linear `X`
are stored as `X.codes`, `X.codebooks`, `X.scales` (and `X.bias`), which is exactly the parameter
layout of `aqlm.QuantizedLinear`. `dequantized_model` is the reference it must agree with: the
full-precision model with each quantized weight replaced by the weight its codes represent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from aqflow.io.artifacts import ArtifactError, atomic_dir, decoding, read_json, recorded_sha256, verified, verified_tree, write_json
from .models import folder as model_folder
from .models.fetch import load_causal_lm, torch_dtype as to_torch_dtype
from .models.structure import find_decoder_blocks, find_linears, meta_model
from .quant.representation import GROUP_SIZE, MAX_NBITS, aqlm_code_dtype, codebook_size, dequantize_weight, unpack_codes


class CheckpointError(ValueError):
    """A layer artifact is missing or does not fit the model; the message names module and file."""


# --- layout ------------------------------------------------------------------------------------

def layer_artifact_path(layers_dir: str | os.PathLike, module_name: str) -> Path:
    """Where the result for the linear `module_name` (full dotted name, e.g.
    `model.layers.0.self_attn.q_proj`) lives: `layers_dir/<module_name>.safetensors`."""
    return Path(layers_dir) / f"{module_name}.safetensors"


def quantized_linear_names(model: nn.Module) -> list[str]:
    """Full names of the linears that are quantized: every nn.Linear of every decoder block, in
    module order (the head, embeddings and anything outside the blocks stay in full precision)."""
    blocks_name, blocks = find_decoder_blocks(model)
    return [f"{blocks_name}.{index}.{name}" for index, block in enumerate(blocks) for name in find_linears(block)]


def not_quantized_names(model: nn.Module, quantized: list[str]) -> list[str]:
    """`linear_weights_not_to_quantize` for the AQLM config: every module outside `quantized` that
    owns a weight, both as a module name (`lm_head`: transformers >= 5 matches module names) and as
    a parameter name (`lm_head.weight`: what transformers 4.x compared against).

    Raises if one of these names would also exclude a quantized linear under the transformers
    matching rules (equal, a prefix at a module boundary, or a suffix).
    """
    quantized_set = set(quantized)
    modules = [name for name, module in model.named_modules()
               if name and name not in quantized_set and "weight" in dict(module.named_parameters(recurse=False))]
    for pattern in modules:
        clashes = [q for q in quantized if q == pattern or q.startswith(pattern + ".") or q.endswith(pattern)]
        if clashes:
            raise CheckpointError(f"module {pattern!r} stays in full precision, but listing it in "
                                  f"linear_weights_not_to_quantize would also exclude {clashes[:3]}")
    return sorted(modules + [f"{name}.weight" for name in modules])


# --- layer artifacts ---------------------------------------------------------------------------

def read_layer_artifact(layers_dir: str | os.PathLike, module_name: str, linear: nn.Linear,
                        num_codebooks: int | None = None, nbits: int | None = None,
                        group_size: int | None = None) -> dict[str, torch.Tensor]:
    """Load and check the artifact of one linear [out, in].

    Returns {"codes": [out, in/g, M] packed int, "codebooks": [M, K, 1, g], "scales": [out, 1, 1, 1]}
    as stored. M, K = 2^nbits and g are read from the codebooks; where `num_codebooks`, `nbits`
    or `group_size` are given they must agree. Raises CheckpointError naming module and file.
    """
    from safetensors.torch import load_file

    path = layer_artifact_path(layers_dir, module_name)
    if not path.is_file():
        raise CheckpointError(f"{module_name}: no layer artifact {path}")
    check_layer_pair(path)
    with decoding(path, "safetensors file"):
        tensors = load_file(str(path))
    missing = [key for key in model_folder.AQLM_TENSORS if key not in tensors]
    if missing:
        raise CheckpointError(f"{module_name}: {path} lacks tensors {missing} (has {sorted(tensors)})")
    codes, codebooks, scales = (tensors[key] for key in model_folder.AQLM_TENSORS)
    if codebooks.dim() != 4 or codebooks.shape[2] != 1:
        raise CheckpointError(f"{module_name}: {path} has codebooks of shape {tuple(codebooks.shape)}, "
                              "expected [M, K, 1, g]")
    found_m, found_k, _, found_g = codebooks.shape
    found_nbits = found_k.bit_length() - 1
    settings = {"num_codebooks": (num_codebooks, found_m), "nbits": (nbits, found_nbits),
                "group_size": (group_size, found_g)}
    wrong = {name: f"{got} (expected {want})" for name, (want, got) in settings.items()
             if want is not None and want != got}
    if codebook_size(found_nbits) != found_k:
        wrong["codebook_size"] = f"{found_k} (not a power of two)"
    if wrong:
        raise CheckpointError(f"{module_name}: {path} was quantized with other settings: {wrong}")
    out_features, in_features = linear.out_features, linear.in_features
    shapes = {"codes": (codes, (out_features, in_features // found_g, found_m)),
              "scales": (scales, (out_features, 1, 1, 1))}
    mismatched = {key: f"{tuple(tensor.shape)} (expected {want})" for key, (tensor, want) in shapes.items()
                  if tuple(tensor.shape) != want}
    if in_features % found_g or mismatched:
        raise CheckpointError(f"{module_name}: {path} does not fit the linear [{out_features}, {in_features}] "
                              f"with group size {found_g}: {mismatched or 'in_features not divisible'}")
    if codes.dtype != aqlm_code_dtype(found_nbits):
        raise CheckpointError(f"{module_name}: {path} stores codes as {codes.dtype}, but {found_nbits}-bit codes "
                              f"are {aqlm_code_dtype(found_nbits)} in the AQLM format")
    return {"codes": codes, "codebooks": codebooks, "scales": scales}


def _artifact_dir(layers_dirs: list[Path], module_name: str) -> Path:
    """The one folder of `layers_dirs` holding `module_name`'s artifact (the first if none does, so
    the error names it); an artifact in two folders is ambiguous and refused."""
    holders = [d for d in layers_dirs if layer_artifact_path(d, module_name).is_file()]
    if len(holders) > 1:
        raise CheckpointError(f"{module_name}: artifacts in several layer folders {[str(d) for d in holders]}")
    return holders[0] if holders else layers_dirs[0]


def _as_dirs(layers_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    dirs = [Path(layers_dir)] if isinstance(layers_dir, (str, os.PathLike)) else [Path(d) for d in layers_dir]
    if not dirs:
        raise ValueError("no layers folder given")
    return dirs


def check_layer_pair(path: Path) -> None:
    """The layer file matches its recorded checksum and, where its metrics JSON (same stem) records
    `tensors_sha256`, that one too: quantize-layer writes the JSON first, so a crash between the
    two leaves a pair that disagrees here instead of a silently mixed one."""
    verified(path)
    metrics_path = path.with_suffix(".json")
    if not metrics_path.is_file():
        return
    bound = read_json(metrics_path).get("tensors_sha256")
    if bound is not None and bound != recorded_sha256(path):
        raise ArtifactError(f"{path}: its metrics {metrics_path.name} were written for other tensors "
                            f"(sha256 {bound[:16]}..., the file has {recorded_sha256(path)[:16]}...): the "
                            f"layer job was interrupted between its two files; delete both and rerun "
                            f"(or `snakemake --forcerun quantize_layer`)")


def _read_all_artifacts(model: nn.Module, names: list[str], layers_dir: list[Path],
                        **expected: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every artifact, checked; one error listing every module whose artifact is missing or wrong.
    layers_dir: the folders to look in; each module's artifact must be in exactly one of them."""
    found, problems = {}, []
    for name in names:
        try:
            found[name] = read_layer_artifact(_artifact_dir(layers_dir, name), name, model.get_submodule(name),
                                              **expected)
        except CheckpointError as error:
            problems.append(str(error))
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(f"{len(problems)} of {len(names)} quantized linears have no usable artifact "
                              f"in {', '.join(str(d) for d in layers_dir)}:\n  {shown}")
    return found


# --- the checkpoint ----------------------------------------------------------------------------

def write_aqlm_checkpoint(model_dir: str | os.PathLike, layers_dir: str | os.PathLike | Sequence[str | os.PathLike],
                          output_dir: str | os.PathLike, num_codebooks: int, nbits: int, group_size: int = GROUP_SIZE,
                          dtype: str = "float16", replaced_tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write a standard AQLM checkpoint folder at `output_dir` (atomically: staged, then renamed).

    Every linear of every decoder block must have its artifact in `layers_dir`, quantized with
    `num_codebooks` codebooks of 2^`nbits` codewords over groups of `group_size` inputs. Quantized
    linear `X` is stored as `X.codes` (packed int), `X.codebooks` and `X.scales` (in `dtype`) and
    `X.bias`; every other tensor of the model is copied, floating ones cast to `dtype` (tied
    embeddings stay tied: the head is not quantized and the file keeps what the source kept).
    Tokenizer and generation config are copied. Nothing is written if any check fails.

    layers_dir may be several folders (e.g. one per fine-tuned block); each artifact must be in
    exactly one. replaced_tensors: full-precision tensors of the model to store instead of the
    source's (block fine-tuning's tuned norms and biases); each must exist with the same shape.
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    layers_dirs = _as_dirs(layers_dir)
    torch_dtype = to_torch_dtype(dtype)
    if num_codebooks < 1 or not 1 <= nbits <= MAX_NBITS or group_size < 1:
        raise CheckpointError(f"need num_codebooks >= 1, 1 <= nbits <= {MAX_NBITS} and group_size >= 1; "
                         f"got {num_codebooks}, {nbits}, {group_size}")
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} already exists; remove it to stitch again")
    verified_tree(model_dir)
    config = model_folder.read_config(model_dir)
    for folder in layers_dirs:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such layers folder")
    model = meta_model(model_dir)
    quantized = quantized_linear_names(model)
    keep_fp = not_quantized_names(model, quantized)
    layers = _read_all_artifacts(model, quantized, layers_dirs,
                                 num_codebooks=num_codebooks, nbits=nbits, group_size=group_size)

    quantized_weights = {f"{name}.weight" for name in quantized}
    absent = quantized_weights - model_folder.tensor_headers(model_dir).keys()
    if absent:
        raise CheckpointError(f"{model_dir} has no weights for the quantized linears {sorted(absent)[:5]}")
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in model_folder.iter_tensors(model_dir, skip=quantized_weights):
        tensors[key] = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
    for key, tensor in (replaced_tensors or {}).items():
        if key not in tensors or tensors[key].shape != tensor.shape:
            raise CheckpointError(f"replacement tensor {key!r} {tuple(tensor.shape)} matches no full-precision "
                                  f"tensor of {model_dir}")
        tensors[key] = tensor.to(torch_dtype)
    for name, layer in layers.items():
        tensors[f"{name}.codes"] = layer["codes"]
        tensors[f"{name}.codebooks"] = layer["codebooks"].to(torch_dtype)
        tensors[f"{name}.scales"] = layer["scales"].to(torch_dtype)

    config.update(dtype=dtype, torch_dtype=dtype, quantization_config=model_folder.new_aqlm_quantization_config(
        num_codebooks, nbits, group_size, not_quantized=keep_fp))
    with atomic_dir(output_dir, replace=False) as staging:
        model_folder.write_weights(staging, tensors)
        model_folder.write_config(staging, config)
        model_folder.copy_side_files(model_dir, staging)
        write_json(staging / model_folder.MARKER_FILE, {
            "source_model": str(model_dir),
            "source_marker": model_folder.read_marker(model_dir),
            "layers_dir": str(layers_dirs[0]) if len(layers_dirs) == 1 else [str(d) for d in layers_dirs],
            "replaced_tensors": sorted(replaced_tensors or {}),
            "dtype": dtype,
            "quantization": {"num_codebooks": num_codebooks, "nbits": nbits, "group_size": group_size},
            "quantized_linears": len(quantized),
            "stored_bits_per_parameter": model_folder.stored_bits_per_parameter(staging)["bits_per_parameter"],
        })
    return output_dir


def dequantized_model(model_dir: str | os.PathLike, layers_dir: str | os.PathLike) -> nn.Module:
    """The float32 model of `model_dir` with every quantized linear's weight [out, in] replaced by
    `dequantize_weight(codes, codebooks, scales)` from its artifact: the reference a stitched
    checkpoint must reproduce. Raises CheckpointError if an artifact is missing or wrong."""
    model = load_causal_lm(model_dir, dtype="float32")
    names = quantized_linear_names(model)
    layers = _read_all_artifacts(model, names, _as_dirs(layers_dir))
    with torch.no_grad():
        for name, layer in layers.items():
            nbits = layer["codebooks"].shape[1].bit_length() - 1
            codes = unpack_codes(layer["codes"], nbits)  # [out, in/g, M] int64
            model.get_submodule(name).weight.copy_(
                dequantize_weight(codes, layer["codebooks"].float(), layer["scales"].float()))
    return model
