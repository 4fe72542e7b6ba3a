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

import dataclasses
import hashlib
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.io.finite import NonFiniteMetricError, require_finite
from aqflow.models.folder import split_module_name
from aqflow.quant.quantize import QuantizerSettings, layer_summary, quantize_layer
from aqflow.quant.representation import pack_codes
from aqflow.quant.validation import QuantizationInputError
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError
from aqflow.io.tensor_files import load_tensor

STAGE = "quantize-layer"
INPUT_ERRORS = (*EXPECTED_ERRORS, NonFiniteMetricError, QuantizationInputError)


@dataclass(frozen=True)
class QuantizeLayerSettings:
    quantizer: QuantizerSettings = field(default_factory=QuantizerSettings)
    device: str = field(default_factory=stage_cli.default_device, metadata=option("cpu, cuda or cuda:N"))
    name: str | None = field(default=None, metadata=option("layer name recorded in the metrics (default: --layer, or the weight file's stem)"))
    quiet: bool = field(default=False, metadata=option("no progress bar"))


@dataclass(frozen=True)
class QuantizeLayerPaths:
    output: Path = field(metadata=option("result .safetensors (codes, codebooks, scales)"))
    metrics: Path = field(metadata=option("metrics .json"))
    weight: Path | None = field(default=None, metadata=option("weight file (.safetensors or .npz)"))
    weight_key: str | None = field(default=None, metadata=option("tensor name in the weight file (default: its only tensor)"))
    xtx: Path | None = field(default=None, metadata=option("XᵀX file (.safetensors or .npz)"))
    xtx_key: str | None = field(default=None, metadata=option("tensor name in the XᵀX file (default: its only tensor)"))
    model_dir: Path | None = field(default=None, metadata=option("model folder (instead of --weight)"))
    calibration_dir: Path | None = field(default=None, metadata=option("calibration folder (instead of --xtx)"))
    layer: str | None = field(default=None, metadata=option("module name of the linear, with --model-dir and --calibration-dir"))


def calibration_site(calibration_dir: Path, layer: str) -> dict:
    """The manifest row of the input site of `layer`'s XᵀX (its block file, site, sha256, ...)."""
    from aqflow.calibration.site_xtx import site_row

    block, linear = split_module_name(layer)
    row = site_row(calibration_dir, block, linear)
    if row is None:
        raise StageInputError(f"{calibration_dir}: the manifest has no input site for block {block} linear {linear!r}")
    return row


def load_inputs(paths: QuantizeLayerPaths) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(weight [out, in], XᵀX [in, in], layer name) from files or from model + calibration folders.
    From folders, only the bytes read are verified (the weight's tensor, the site's array)."""
    if paths.layer is not None:
        if paths.model_dir is None or paths.calibration_dir is None:
            raise StageInputError("--layer needs --model-dir and --calibration-dir")
        from aqflow.calibration.site_xtx import read_site_xtx
        from aqflow.models.folder import read_tensor

        xtx = read_site_xtx(paths.calibration_dir, calibration_site(paths.calibration_dir, paths.layer))
        return read_tensor(paths.model_dir, f"{paths.layer}.weight"), torch.from_numpy(xtx), paths.layer
    if paths.weight is None or paths.xtx is None:
        raise StageInputError("give --weight and --xtx, or --model-dir, --calibration-dir and --layer")
    return load_tensor(paths.weight, paths.weight_key), load_tensor(paths.xtx, paths.xtx_key), paths.weight.stem


def run(settings: QuantizeLayerSettings, paths: QuantizeLayerPaths) -> dict:
    """Quantize the layer and write its tensors and metrics; the metrics."""
    weight, xtx, default_name = load_inputs(paths)
    inputs = {k: str(getattr(paths, k)) for k in ("weight", "xtx", "model_dir", "calibration_dir") if getattr(paths, k)}
    return quantize_and_write(weight, xtx, settings.quantizer, settings.name or default_name, paths.output,
                              paths.metrics, settings.device, progress=not settings.quiet, inputs=inputs)


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
                          group_size: int = QuantizerSettings.group_size) -> list[str]:
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


def summary(metrics: dict) -> str:
    return (f"{metrics['layer']}: relative MSE {metrics['init_relative_mse']:.5f} after init -> "
            f"{metrics['final_relative_mse']:.5f} after {len(metrics['epochs'])} epochs "
            f"({metrics['total_seconds']:.1f} s, rho {metrics['rho']:.3g})")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
