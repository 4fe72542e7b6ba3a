"""What PV-tuning holds on its device before any activation, from the checkpoints' safetensors
headers alone (nothing is loaded): a card too small for it is named in seconds, not after minutes
of loading and an out-of-memory error in the first step.

Per part, in bytes (the student trains in float32, `student.load_student`):

* teacher: every tensor of the source model in its compute dtype;
* codes: [out, G, M] int32 per quantized linear;
* V-step: per quantized weight, the float32 straight-through copy, its gradient and Adam's moments
  (one at code_beta1 0, `vstep_adam`; two otherwise): 12 or 16 bytes; without the V-step but with
  the P-step, the 4-byte weight-gradient buffer;
* codebooks and scales: float32, with gradient and two moments when the P-step trains them;
* the rest (embeddings, head, norms, biases): float32, with gradient and two moments when
  `update_non_quantized`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from ..models.folder import TensorHeader
from .train import PVSettings
from .vstep_adam import state_bytes_per_parameter_byte

FLOAT32 = 4
ADAM = 3  # a trained float32 tensor's gradient and two moments, in units of the tensor's bytes
QUANTIZED_SUFFIXES = (".codes", ".codebooks", ".scales")


class PVMemoryError(ValueError):
    """PV-tuning's state does not fit the device's memory."""


def state_bytes(student: Mapping[str, TensorHeader], teacher: Mapping[str, TensorHeader], teacher_bytes: int,
                settings: PVSettings) -> dict[str, int]:
    """Bytes per part of the state (module docstring) for the student checkpoint's and the
    teacher's tensor headers, the teacher's bytes per value and the loop's settings."""
    prefixes = [name[: -len(".codes")] for name in student if name.endswith(".codes")]
    weights = codes = codebooks_and_scales = 0
    for prefix in prefixes:
        out_rows, groups, num_codebooks = student[f"{prefix}.codes"].shape[:3]
        group_size = student[f"{prefix}.codebooks"].shape[-1]
        weights += out_rows * groups * group_size
        codes += out_rows * groups * num_codebooks * 4
        codebooks_and_scales += (student[f"{prefix}.codebooks"].numel + student[f"{prefix}.scales"].numel) * FLOAT32
    if settings.update_codes:
        v_step = weights * FLOAT32 * (2 + state_bytes_per_parameter_byte(settings.code_beta1))
    elif settings.update_codebooks_and_scales:
        v_step = weights * FLOAT32  # the weight-gradient buffer the P-step reads
    else:
        v_step = 0
    if settings.update_codebooks_and_scales:
        codebooks_and_scales *= 1 + ADAM
    rest = sum(header.numel for name, header in student.items() if not name.endswith(QUANTIZED_SUFFIXES)) * FLOAT32
    if settings.update_non_quantized:
        rest *= 1 + ADAM
    return {"teacher": sum(header.numel for header in teacher.values()) * teacher_bytes, "codes": codes,
            "v_step": v_step, "codebooks_and_scales": codebooks_and_scales, "non_quantized": rest}


def require_fit(parts: Mapping[str, int], device_bytes: int, device: str) -> None:
    """PVMemoryError naming every part where their sum exceeds `device_bytes`."""
    total = sum(parts.values())
    if total <= device_bytes:
        return
    gib = 2.0**30
    listed = ", ".join(f"{name} {size / gib:.1f}" for name, size in parts.items())
    raise PVMemoryError(
        f"PV-tuning needs {total / gib:.1f} GiB on {device} before any activation ({listed} GiB), and it has "
        f"{device_bytes / gib:.1f} GiB. Every torchrun process holds all of it. What shrinks it: pvtune.code_beta1 0 "
        f"(no first moment for the V-step), pvtune.update_non_quantized false, pvtune.update_codes false "
        f"(no V-step), or a card with more memory")


def wait_for_free_memory(needed: int, free_bytes: Callable[[], int], timeout_seconds: float, poll_seconds: float = 5.0,
                         sleep: Callable[[float], None] = time.sleep,
                         clock: Callable[[], float] = time.monotonic) -> tuple[int, float]:
    """Poll `free_bytes()` until it reports at least `needed` bytes or `timeout_seconds` have
    passed; (the free bytes last seen, seconds waited). On a node whose jobs share cards, the
    other jobs' memory is released when they end, so a PV-tuning run that waits for it starts
    instead of running out of memory while it loads."""
    start = clock()
    free = free_bytes()
    while free < needed and clock() - start < timeout_seconds:
        sleep(min(poll_seconds, max(timeout_seconds - (clock() - start), 0.0)))
        free = free_bytes()
    return free, clock() - start
