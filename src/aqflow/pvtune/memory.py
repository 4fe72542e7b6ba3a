"""What PV-tuning holds on each process's card before any activation, from the checkpoints'
safetensors headers alone (nothing is loaded): a card too small for it is named in seconds, not
after minutes of loading and an out-of-memory error in the first step, with the smallest number
of such cards that holds it and whether one card does with the V-step's state in host memory.

Per part, in bytes per process of `world_size` (the student trains in float32,
`student.load_student`; what is sharded, `distributed`, is divided by the processes):

* teacher: every tensor of the source model in its compute dtype (sharded);
* codes: [out, G, M] int16 (int32 beyond 15-bit codes) per quantized linear (whole on every process);
* V-step: per quantized weight, the float32 straight-through copy, its gradient and Adam's moments
  (one at code_beta1 0, `vstep_adam`; two otherwise): 12 or 16 bytes (sharded by rows); with
  v_state "host" only the 4-byte gradient stays on the card, the rest is `host_bytes`; without
  the V-step but with the P-step, the 4-byte weight-gradient buffer;
* codebooks and scales: float32, with gradient and two moments when the P-step trains them (whole);
* the rest (embeddings, head, norms, biases): float32, with gradient and two moments when
  `update_non_quantized` (sharded); with v_state "host" the moments are in host memory too;
* gathered (several processes only): what FSDP2 holds whole for a while: the student's root unit
  (embeddings, final norm, head) with its gradient, the teacher's, and two decoder blocks of each.
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
MOST_PROCESSES = 64
GIB = 2.0**30


class PVMemoryError(ValueError):
    """PV-tuning's state does not fit the device's memory."""


def _quantized_prefixes(student: Mapping[str, TensorHeader]) -> list[str]:
    return [name[: -len(".codes")] for name in student if name.endswith(".codes")]


def _quantized_weights(student: Mapping[str, TensorHeader]) -> int:
    """Weights the quantized linears represent (out x in, summed)."""
    total = 0
    for prefix in _quantized_prefixes(student):
        out_rows, groups = student[f"{prefix}.codes"].shape[:2]
        total += out_rows * groups * student[f"{prefix}.codebooks"].shape[-1]
    return total


def _block_bytes(headers: Mapping[str, TensorHeader], bytes_per_value: int, skip=()) -> tuple[int, int]:
    """(the largest decoder block's bytes, the bytes outside every block) of a model's tensors,
    blocks told by their `.layers.<i>.` names; tensors ending in `skip` are not counted."""
    blocks: dict[str, int] = {}
    outside = 0
    for name, header in headers.items():
        if name.endswith(skip):
            continue
        size = header.numel * bytes_per_value
        head, marker, tail = name.partition(".layers.")
        if marker and tail.split(".", 1)[0].isdigit():
            key = head + marker + tail.split(".", 1)[0]
            blocks[key] = blocks.get(key, 0) + size
        else:
            outside += size
    return max(blocks.values(), default=0), outside


def state_bytes(student: Mapping[str, TensorHeader], teacher: Mapping[str, TensorHeader], teacher_bytes: int,
                settings: PVSettings, world_size: int = 1, v_state: str = "device") -> dict[str, int]:
    """Bytes per part of one process's state on its card (module docstring) for the student
    checkpoint's and the teacher's tensor headers, the teacher's bytes per value, the loop's
    settings, the number of processes and where the V-step's state lives ("device" or "host")."""
    weights = _quantized_weights(student)
    codes = codebooks_and_scales = 0
    for prefix in _quantized_prefixes(student):
        out_rows, groups, num_codebooks = student[f"{prefix}.codes"].shape[:3]
        code_bytes = 2 if student[f"{prefix}.codebooks"].shape[1] <= 1 << 15 else 4  # student.code_dtype
        codes += out_rows * groups * num_codebooks * code_bytes
        codebooks_and_scales += (student[f"{prefix}.codebooks"].numel + student[f"{prefix}.scales"].numel) * FLOAT32
    if settings.update_codes:
        per_weight = FLOAT32 if v_state == "host" else FLOAT32 * (2 + state_bytes_per_parameter_byte(settings.code_beta1))
        v_step = weights * per_weight
    elif settings.update_codebooks_and_scales:
        v_step = weights * FLOAT32  # the weight-gradient buffer the P-step reads
    else:
        v_step = 0
    if settings.update_codebooks_and_scales:
        codebooks_and_scales *= 1 + ADAM
    rest = sum(header.numel for name, header in student.items() if not name.endswith(QUANTIZED_SUFFIXES)) * FLOAT32
    # with v_state "host" the two Adam moments are in host memory too (`offload.HostMomentsAdam`)
    trained_rest = rest * (1 + (ADAM if v_state != "host" else 1)) if settings.update_non_quantized else rest
    teacher_total = sum(header.numel for header in teacher.values()) * teacher_bytes
    parts = {"teacher": -(-teacher_total // world_size), "codes": codes, "v_step": -(-v_step // world_size),
             "codebooks_and_scales": codebooks_and_scales, "non_quantized": -(-trained_rest // world_size)}
    if world_size > 1:
        student_block, student_root = _block_bytes(student, FLOAT32, skip=QUANTIZED_SUFFIXES)
        teacher_block, teacher_root = _block_bytes(teacher, teacher_bytes)
        gradients = 2 if settings.update_non_quantized else 1
        parts["gathered"] = gradients * student_root + teacher_root + 2 * (gradients * student_block + teacher_block)
    return parts


def host_bytes(student: Mapping[str, TensorHeader], settings: PVSettings) -> int:
    """Host memory the state takes with v_state "host": each quantized weight's straight-through
    copy and its Adam moments (8 or 12 bytes), and the two Adam moments of every trained
    non-quantized weight (8 bytes)."""
    v_step = 0
    if settings.update_codes:
        v_step = _quantized_weights(student) * FLOAT32 * (1 + state_bytes_per_parameter_byte(settings.code_beta1))
    rest = sum(header.numel for name, header in student.items() if not name.endswith(QUANTIZED_SUFFIXES))
    return v_step + (rest * 2 * FLOAT32 if settings.update_non_quantized else 0)


def _listed(parts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items())


def require_fit(parts: Mapping[str, int], device_bytes: int, device: str) -> None:
    """PVMemoryError naming every part where their sum exceeds `device_bytes`."""
    total = sum(parts.values())
    if total <= device_bytes:
        return
    raise PVMemoryError(
        f"PV-tuning needs {total / GIB:.1f} GiB on {device} before any activation ({_listed(parts)} GiB), and it has "
        f"{device_bytes / GIB:.1f} GiB. What shrinks it: more processes (each holds its share of the sharded parts), "
        f"pvtune.code_beta1 0 (no first moment for the V-step), pvtune.update_non_quantized false, "
        f"pvtune.update_codes false (no V-step), or a card with more memory")


def smallest_world(fits: Callable[[int], bool], most: int = MOST_PROCESSES) -> int | None:
    """The fewest processes (1..most) for which `fits(processes)` holds, or None."""
    return next((size for size in range(1, most + 1) if fits(size)), None)


def plan_v_state(student: Mapping[str, TensorHeader], teacher: Mapping[str, TensorHeader], teacher_bytes: int,
                 settings: PVSettings, world_size: int, card_bytes: int, host_available: int,
                 device: str) -> tuple[str, dict[str, int]]:
    """(where the V-step's state lives, one process's parts on its card) for settings.v_state
    ("auto": on the card where it fits, else, in one process, in host memory where that fits).

    Raises PVMemoryError where nothing chosen fits, naming the parts, the smallest number of
    processes on cards of this size that holds them, and whether one card does with v_state host.
    """
    wanted = ("device", "host") if settings.v_state == "auto" else (settings.v_state,)
    for v_state in wanted:
        if v_state == "host" and (world_size > 1 or host_bytes(student, settings) > host_available):
            continue
        parts = state_bytes(student, teacher, teacher_bytes, settings, world_size, v_state)
        if sum(parts.values()) <= card_bytes:
            return v_state, parts
    parts = state_bytes(student, teacher, teacher_bytes, settings, world_size, wanted[0])

    def fits_on(size: int) -> bool:
        return sum(state_bytes(student, teacher, teacher_bytes, settings, size, "device").values()) <= card_bytes

    cards = smallest_world(fits_on)
    single_host = sum(state_bytes(student, teacher, teacher_bytes, settings, 1, "host").values())
    options = [f"{cards} processes on cards of this size (torchrun --nproc-per-node {cards}; in the pipeline the "
               f"pvtune job's gpu resource)" if cards else f"no number of cards of this size up to {MOST_PROCESSES}"]
    if settings.update_codes and single_host <= card_bytes:
        options.append(f"one process with the V-step's state in host memory (pvtune.v_state: host; "
                       f"{single_host / GIB:.1f} GiB on the card, {host_bytes(student, settings) / GIB:.1f} GiB of host "
                       f"memory, {host_available / GIB:.1f} GiB available)")
    raise PVMemoryError(
        f"PV-tuning over {world_size} process(es) needs {sum(parts.values()) / GIB:.1f} GiB per process on {device} "
        f"before any activation ({_listed(parts)} GiB), and it has {card_bytes / GIB:.1f} GiB. It fits on "
        + "; or on ".join(options))


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
