"""`python -m aqflow quantize-layer`: one linear layer from a weight file and an XᵀX file.

Inputs either as files (--weight/--xtx with optional keys), or as the pipeline passes them: a model
folder, a calibration folder (from `calibrate`) and the layer's module name (--model-dir,
--calibration-dir, --layer model.layers.3.mlp.down_proj); the layer's XᵀX site is looked up in the
calibration manifest.

Writes the AQLM-layout result (codes packed as AQLM stores them, codebooks, scales) as
safetensors and a metrics JSON (relative output MSE after init and after every epoch, seconds
per stage, rho, bits per parameter, settings). Inputs are checked before any work; on a bad
input nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
from pathlib import Path

import torch

from aqflow import artifacts
from aqflow.finite import require_finite
from aqflow.models.folder import split_module_name
from aqflow.quant.quantize import QuantizerSettings, layer_summary, quantize_layer
from aqflow.quant.representation import pack_codes
from aqflow.quant.validation import QuantizationInputError
from aqflow.tensor_files import load_tensor
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One --option per QuantizerSettings field, defaults from the dataclass."""
    for field in dataclasses.fields(QuantizerSettings):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=field.default, metavar="BOOL")
        else:
            kind = {"int": int, "float": float, "str": str}[str(field.type)]
            parser.add_argument(flag, type=kind, default=field.default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow quantize-layer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight", type=Path, help="weight file (.safetensors or .npz)")
    parser.add_argument("--weight-key", default=None, help="tensor name in the weight file (default: its only tensor)")
    parser.add_argument("--xtx", type=Path, help="XᵀX file (.safetensors or .npz)")
    parser.add_argument("--xtx-key", default=None, help="tensor name in the XᵀX file (default: its only tensor)")
    parser.add_argument("--model-dir", type=Path, help="model folder (instead of --weight)")
    parser.add_argument("--calibration-dir", type=Path, help="calibration folder (instead of --xtx)")
    parser.add_argument("--layer", help="module name of the linear, with --model-dir and --calibration-dir")
    parser.add_argument("--output", required=True, type=Path, help="result .safetensors (codes, codebooks, scales)")
    parser.add_argument("--metrics", required=True, type=Path, help="metrics .json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default=None, help="layer name recorded in the metrics")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_settings_arguments(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> QuantizerSettings:
    return QuantizerSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(QuantizerSettings)})


def calibration_site(calibration_dir: Path, layer: str) -> tuple[Path, str]:
    """(block file, NPZ key) holding the XᵀX of `layer`'s input."""
    from aqflow.calibration.hessians import load_manifest

    block, linear = split_module_name(layer)
    manifest = load_manifest(calibration_dir, verify=True, blocks=[block])
    rows = manifest[(manifest["block"] == block) & manifest["linears"].apply(lambda names: linear in list(names))]
    if rows.empty:
        raise KeyError(f"{calibration_dir}: the manifest has no input site for block {block} linear {linear!r}")
    return calibration_dir / rows.iloc[0]["file"], f"xtx/{rows.iloc[0]['site']}"


def load_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(weight [out, in], XᵀX [in, in], layer name) from files or from model + calibration folders."""
    if args.layer is not None:
        if args.model_dir is None or args.calibration_dir is None:
            raise ValueError("--layer needs --model-dir and --calibration-dir")
        from aqflow.models.folder import read_tensor

        block_file, key = calibration_site(args.calibration_dir, args.layer)
        return read_tensor(args.model_dir, f"{args.layer}.weight"), load_tensor(block_file, key, verify=True), args.layer
    if args.weight is None or args.xtx is None:
        raise ValueError("give --weight and --xtx, or --model-dir, --calibration-dir and --layer")
    return load_tensor(args.weight, args.weight_key), load_tensor(args.xtx, args.xtx_key), args.weight.stem


def run(args: argparse.Namespace) -> dict:
    weight, xtx, default_name = load_inputs(args)
    inputs = {k: str(getattr(args, k)) for k in ("weight", "xtx", "model_dir", "calibration_dir") if getattr(args, k)}
    return quantize_and_write(weight, xtx, settings_from_args(args), args.name or default_name, args.output,
                              args.metrics, args.device, progress=not args.quiet, inputs=inputs)


def quantize_and_write(weight: torch.Tensor, xtx: torch.Tensor, settings: QuantizerSettings, name: str,
                       output: Path, metrics_path: Path, device: str | torch.device = "cpu", progress: bool = False,
                       inputs: dict | None = None) -> dict:
    """Quantize one linear (weight [out, in], xtx [in, in]) and write its layer artifact pair
    (`output` .safetensors in AQLM's layout, `metrics_path` .json); returns the metrics."""
    layer, report = quantize_layer(weight, xtx, settings, device=device, progress=progress, name=name)
    metrics = {
        "layer": name,
        **layer_summary(weight.shape[0], weight.shape[1], settings),
        "init_relative_mse": report.init_relative_mse,
        "final_relative_mse": report.final_relative_mse,
        "init_seconds": report.init_seconds,
        "total_seconds": report.total_seconds,
        "epochs": report.epochs,
        "stopped_because": report.stopped_because,
        "settings": dataclasses.asdict(settings),
        "device": str(device) if not str(device).startswith("cuda") else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "inputs": inputs or {},
    }
    require_finite({key: metrics[key] for key in ("init_relative_mse", "final_relative_mse", "epochs")},
                   f"quantize-layer {name}", str(inputs.get("model_dir") or inputs.get("weight")) if inputs else name)
    tensors = {
        "codes": pack_codes(layer.codes, settings.nbits),
        "codebooks": layer.codebooks,
        "scales": layer.scales,
    }
    meta = {"settings": json.dumps(dataclasses.asdict(settings)), "layer": name, "format": "aqlm"}
    write_layer_pair(Path(output), Path(metrics_path), tensors, meta, metrics)
    return metrics


def quantize_every_linear(model_dir: str | Path, layers_dir: str | Path, nbits: int, num_codebooks: int = 2,
                          group_size: int = 8) -> list[str]:
    """A quick, rough quantization of every decoder linear of a (tiny) model folder, for tests and
    dry runs: XᵀX = I, beam 2 and one 5-step epoch. Writes each layer's tensors where the pipeline
    does (`checkpoint.layer_artifact_path`) and its metrics under `<layers_dir>-inputs/` (so tests
    may edit a layer file without breaking a pair); returns the linears' names."""
    from aqflow.checkpoint import layer_artifact_path, quantized_linear_names
    from aqflow.models.fetch import load_causal_lm

    settings = QuantizerSettings(num_codebooks=num_codebooks, nbits=nbits, group_size=group_size, beam_size=2,
                                 max_epochs=1, steps_per_epoch=5, oaem_rounds=1, oaem_steps=5, kmeans_max_iter=10)
    model = load_causal_lm(model_dir)
    names = quantized_linear_names(model)
    for name in names:
        weight = model.get_submodule(name).weight.detach()
        metrics = Path(layers_dir).parent / f"{Path(layers_dir).name}-inputs" / f"{name}.json"
        quantize_and_write(weight, torch.eye(weight.shape[1], dtype=torch.float64), settings, name,
                           layer_artifact_path(Path(layers_dir), name), metrics, inputs={"model_dir": str(model_dir)})
    return names


def write_layer_pair(output: Path, metrics_path: Path, tensors: dict, meta: dict, metrics: dict) -> None:
    """The layer's tensors and metrics as one unit: the metrics JSON, written first, records the
    sha256 of the tensor file's bytes, then the tensor file is renamed into place. A crash between
    the two leaves a JSON whose `tensors_sha256` matches no tensor file (missing, or an older one),
    which stitch refuses (`aqflow.checkpoint.read_layer_artifact`): there is never a pair that
    looks finished but is half old, half new."""
    from safetensors.torch import save

    payload = save({key: value.detach().contiguous() for key, value in tensors.items()}, metadata=meta)
    artifacts.write_json(metrics_path, metrics | {"tensors_file": output.name,
                                                  "tensors_sha256": hashlib.sha256(payload).hexdigest()})
    try:
        with artifacts.atomic_path(output) as tmp:
            tmp.write_bytes(payload)
    except BaseException:  # e.g. the disk filled up: take back the metrics, leave no lone half of the pair
        for path in (metrics_path, artifacts.sidecar_path(metrics_path)):
            path.unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        metrics = run(args)
    except (*EXPECTED_ERRORS, QuantizationInputError, KeyError, ValueError) as error:
        return report_error("quantize-layer", error)
    print(
        f"{metrics['layer']}: relative MSE {metrics['init_relative_mse']:.5f} after init -> "
        f"{metrics['final_relative_mse']:.5f} after {len(metrics['epochs'])} epochs "
        f"({metrics['total_seconds']:.1f} s, rho {metrics['rho']:.3g})"
    )
    return 0
