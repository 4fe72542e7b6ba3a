"""The PV-tuning loop: KL(teacher || student) on calibration windows, P-step and V-step per step,
held-out evaluation and selection of the best held-out state.

One optimiser step consumes `batch_size` windows, split into micro-batches of
`micro_batch_size` (and, under torch.distributed, over processes: process r takes the
micro-batches r, r + world, ...). Each micro-batch's KL sum is divided by the token count of the
whole batch, so the accumulated gradient, summed over processes, is that of the batch's mean
token KL. `micro_batch_size: 0` picks the largest micro-batch the card's free memory allows,
measured on one window before training (`choose_micro_batch_size`; 1 on a CPU), and with
`gradient_checkpointing: auto` keeps every block's activations instead of recomputing them
where the card has room for one window so; a step that still runs out of memory is redone with
half as many (one process; `batch_gradients`). The quantized layers' dL/dW is summed over the
micro-batches and pushed into codebooks and scales once per step
(`student.open_weight_gradients`). On a GPU, float32 matmuls outside autocast may use TF32.
Then:

* P-step: Adam on codebooks, scales and, optionally, every non-quantized parameter (norms,
  embeddings, head, biases).
* V-step: Adam on each layer's straight-through weight (its gradient is dL/dW; with beta1 = 0
  one that keeps no first moment, `vstep_adam`), then the codes
  are re-encoded toward it (`vstep.v_step_layer`), at most `max_code_change_fraction` of each
  layer's groups per step. The codes are integer buffers: nothing else ever writes them. With
  `v_state: host` the straight-through weights and their moments (and the P-step's Adam moments
  of the non-quantized parameters, `HostMomentsAdam`) live in host memory and
  stream through the card once a step (`offload`).

Several processes (torchrun) shard the state with FSDP2 and by rows (`distributed`). On one
CUDA card the decoder blocks of both models run compiled (`compiled`; `compile_blocks`).

The held-out windows (calibration documents the training never sees) are scored before the
first step, every `eval_every_steps` steps and after the last; the state with the lowest
held-out `selection_metric` (the training loss, "kl", by default; or "perplexity"; step 0
included) is kept in CPU memory and restored at the end. The teacher's final hidden states of
the held-out windows never change: they are computed at the first evaluation and kept in host
memory. With `plateau_evaluations` set, training ends early once that many evaluations in a row
have not lowered the best held-out metric by `plateau_min_improvement` (relative).
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..quant.representation import pack_codes, unpack_codes
from .compiled import (CHOICES as COMPILE_CHOICES, compile_blocks, compiling, decoder_block_path, kl_kernel,
                       uncompile_blocks)
from .distill import StudentKL, TeacherHidden
from .distributed import (RowReducer, all_reduce_sum, gathered_state, held_bytes, local, row_range,
                          shard_over_processes, world)
from .offload import HostMomentsAdam, HostVStep, move_straight_through_to_host
from .resume import LoopState, Resumer
from .student import PVLinear, close_weight_gradients, open_weight_gradients, pv_linears
from .vstep import DEFAULT_MEMORY_BUDGET_BYTES, VStep
from .vstep_adam import state_bytes_per_parameter_byte, v_step_optimizer

SELECTION_METRICS = ("kl", "perplexity")
CODE_LR_SCALES = ("absolute", "weight_rms")
CHECKPOINTING = ("auto", "always", "never")
HELDOUT_WINDOWS_PER_PASS = 4  # on a GPU, at least
V_STATES = ("auto", "device", "host")


@dataclass(frozen=True)
class PVSettings:
    """Every setting of the loop (defaults: the paper's and AQLM's PV-tuning recipe, but the V-step's step
    relative to each layer's weights)."""

    epochs: int = 5
    batch_size: int = 32  # windows per optimiser step, over all processes
    micro_batch_size: int = 0  # windows per forward pass; 0: as many as the card's memory allows
    lr: float = 3e-4  # P-step Adam
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    code_lr: float = 5e-2  # V-step Adam on the straight-through weights
    # weight_rms: code_lr is the V-step's Adam step in units of each layer's weight RMS at the start;
    # absolute: in weight units (AQLM's recipe, 1e-2). Adam's step hardly depends on the gradient's
    # size, so an absolute step is a far larger move for a model whose weights are small: at the
    # recipe's step Gemma3-270M's PV-tuning never improved on its start.
    code_lr_scale: str = field(default="weight_rms", metadata={"choices": CODE_LR_SCALES,
                                                             "help": "unit of code_lr: weight units, or each layer's weight RMS"})
    code_beta1: float = 0.0
    code_beta2: float = 0.95
    max_code_change_fraction: float = 0.01  # of each layer's groups, per step
    code_beam_size: int = 1
    update_codes: bool = True  # V-step
    update_codebooks_and_scales: bool = True  # P-step
    update_non_quantized: bool = True  # P-step also on norms, embeddings, head, biases
    eval_every_steps: int = 10
    max_steps: int | None = None  # stop early (CPU budgets); None: every epoch
    kl_chunk_tokens: int = 1024
    # auto: recompute each block's activations in the backward pass only where one window's do
    # not fit the card beside the state (measured before training); always; never
    gradient_checkpointing: str = field(default="auto", metadata={"choices": CHECKPOINTING,
                                                                  "help": "recompute activations in the backward pass"})
    # keep every quantized layer's dequantized weight in the autocast dtype from its first use in a
    # step to the optimiser step (2 bytes a weight; auto: on a GPU where the card has room for it
    # twice over beside the state, measured before training)
    keep_weights: str = field(default="auto", metadata={"choices": ("auto", "always", "never"),
                                                        "help": "keep dequantized weights between optimiser steps"})
    # where the V-step's straight-through weights and their moments live: on the card, or in host
    # memory streamed through the card once a step (auto: host only where the card is too small,
    # which the pvtune stage decides from its memory plan; one process only)
    v_state: str = field(default="auto", metadata={"choices": V_STATES,
                                                   "help": "where the V-step's state lives (host: offloaded)"})
    # stop once this many held-out evaluations in a row have not lowered the best held-out metric
    # by plateau_min_improvement (relative); None: train the whole budget
    plateau_evaluations: int | None = None
    plateau_min_improvement: float = 0.01
    # autocast dtype on the accelerator ("bfloat16"), None: float32 (the pvtune stage resolves it
    # from its own --amp-dtype, so it is no command-line option of its own)
    amp_dtype: str | None = field(default=None, metadata={"cli": False})
    seed: int = 0
    selection_metric: str = field(default="kl", metadata={"choices": SELECTION_METRICS,
                                                          "help": "held-out metric that selects the state written out"})
    beam_memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    v_step_graph: bool = True  # on a GPU, replay the V-step of all layers as one CUDA graph
    # torch.compile each decoder block of both models, the quantized linears left eager
    # (`compiled`); auto: on a CUDA card in one process
    compile_blocks: str = field(default="auto", metadata={"choices": COMPILE_CHOICES,
                                                          "help": "compile the decoder blocks (torch.compile)"})

    def __post_init__(self):
        if isinstance(self.gradient_checkpointing, bool):  # configs written before "auto" said true / false
            object.__setattr__(self, "gradient_checkpointing", "always" if self.gradient_checkpointing else "never")
        problems = []
        for name in ("epochs", "batch_size", "code_beam_size", "eval_every_steps", "kl_chunk_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_size < 0:
            problems.append(f"micro_batch_size must be >= 1, or 0 for automatic, got {self.micro_batch_size}")
        if not 0.0 < self.max_code_change_fraction <= 1.0:
            problems.append(f"max_code_change_fraction must lie in (0, 1], got {self.max_code_change_fraction}")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be >= 1 or None, got {self.max_steps}")
        if not (self.update_codes or self.update_codebooks_and_scales or self.update_non_quantized):
            problems.append("nothing to train: enable the V-step, codebooks and scales, or non-quantized parameters")
        if self.code_lr_scale not in CODE_LR_SCALES:
            problems.append(f"code_lr_scale must be one of {CODE_LR_SCALES}, got {self.code_lr_scale!r}")
        if self.selection_metric not in SELECTION_METRICS:
            problems.append(f"selection_metric must be one of {SELECTION_METRICS}, got {self.selection_metric!r}")
        if self.gradient_checkpointing not in CHECKPOINTING:
            problems.append(f"gradient_checkpointing must be one of {CHECKPOINTING}, got {self.gradient_checkpointing!r}")
        if self.keep_weights not in ("auto", "always", "never"):
            problems.append(f"keep_weights must be one of ('auto', 'always', 'never'), got {self.keep_weights!r}")
        if self.compile_blocks not in COMPILE_CHOICES:
            problems.append(f"compile_blocks must be one of {COMPILE_CHOICES}, got {self.compile_blocks!r}")
        if self.v_state not in V_STATES:
            problems.append(f"v_state must be one of {V_STATES}, got {self.v_state!r}")
        if self.plateau_evaluations is not None and self.plateau_evaluations < 1:
            problems.append(f"plateau_evaluations must be >= 1 or None, got {self.plateau_evaluations}")
        if not 0.0 <= self.plateau_min_improvement < 1.0:
            problems.append(f"plateau_min_improvement must lie in [0, 1), got {self.plateau_min_improvement}")
        if self.amp_dtype not in (None, "bfloat16", "float16"):
            problems.append(f"amp_dtype must be None, 'bfloat16' or 'float16', got {self.amp_dtype!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class TrainResult:
    log: list[dict]  # one row per training step and per held-out evaluation
    best_step: int
    best_heldout: dict  # the held-out log row of the selected state
    initial_heldout: dict  # the held-out log row before training
    steps: int
    micro_batch_size: int  # the one used (chosen, if the settings said 0)
    timings: dict[str, float] = field(default_factory=dict)
    gradient_checkpointing: bool = True  # whether activations were recomputed (chosen, if the settings said auto)
    stopped_at_plateau: bool = False  # training ended before its budget (plateau_evaluations)
    budget_steps: int = 0  # the steps the budget allowed
    compiled_blocks: bool = False  # whether the decoder blocks ran compiled (chosen, if the settings said auto)
    state_bytes: int = 0  # the training state this process held in its second step (`distributed.held_bytes`)
    # the student's state dict gathered whole where FSDP2 shards it over processes (None in one
    # process: its modules hold it), what its checkpoint is written from
    student_state: dict[str, torch.Tensor] | None = None


# --- parameters ----------------------------------------------------------------------------------

def v_step_param_groups(weights: list[nn.Parameter], code_lr: float, scale: str,
                        rms: list[float] | None = None) -> list[dict]:
    """The V-step optimiser's parameter groups, one per straight-through weight [rows, in]: at
    `code_lr` ("absolute"), or at code_lr x the RMS of its layer's whole weight ("weight_rms";
    `rms` per weight, default each weight's own, which over several processes is only its rows')."""
    if scale not in CODE_LR_SCALES:
        raise ValueError(f"code_lr_scale must be one of {CODE_LR_SCALES}, got {scale!r}")
    if rms is None:
        rms = [float(weight.detach().float().square().mean().sqrt()) for weight in weights]
    return [{"params": [weight], "lr": code_lr * (1.0 if scale == "absolute" else size)}
            for weight, size in zip(weights, rms)]


@dataclass
class Trainable:
    """What the loop trains: non_quantized (norms, embeddings, head, biases; FSDP2's over several
    processes), quantized (every layer's codebooks [M, K, g] and scales [out]) and
    straight_through (every layer's straight-through weight [rows, in]), in module order."""

    non_quantized: list[nn.Parameter]
    quantized: list[nn.Parameter]
    straight_through: list[nn.Parameter]


def trainable_groups(student: nn.Module, settings: PVSettings) -> Trainable:
    """The student's trainable parameters; sets requires_grad accordingly and creates each layer's
    straight-through weight where the V-step needs one and it is missing (of this process's rows,
    `distributed.row_range`; in host memory with v_state "host"). Tied parameters appear once."""
    layers = pv_linears(student)
    if not layers:
        raise ValueError("the student has no quantized linears (PVLinear)")
    rank, size = world()
    student.requires_grad_(False)
    quantized_ids = set()
    trainable = Trainable([], [], [])
    for layer in layers.values():
        if layer.straight_through is None:
            layer.rows = row_range(layer.out_features, rank, size)
            if settings.update_codes:
                layer.enable_straight_through(layer.rows)
                if settings.v_state == "host":  # one layer at a time: the card never holds them all
                    move_straight_through_to_host([layer])
        quantized_ids.update(id(p) for p in (layer.codebooks, layer.scales))
        if settings.update_codebooks_and_scales:
            trainable.quantized += [layer.codebooks, layer.scales]
        if settings.update_codes:
            trainable.straight_through.append(layer.straight_through)
        if layer.straight_through is not None:
            quantized_ids.add(id(layer.straight_through))
    if settings.update_non_quantized:
        seen = set(quantized_ids)
        for parameter in student.parameters():  # deduplicated: tied embeddings appear once
            if id(parameter) not in seen:
                seen.add(id(parameter))
                trainable.non_quantized.append(parameter)
    for parameter in trainable.non_quantized + trainable.quantized:
        parameter.requires_grad_(True)
    for parameter in trainable.straight_through:  # host-resident ones take no .grad (offload)
        parameter.requires_grad_(parameter.device == layers[next(iter(layers))].codes.device)
    return trainable


def snapshot(student: nn.Module, parameters: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    """CPU copy of everything training changes: {"<layer>.codes": [out, G, M] packed int8/int16
    (the AQLM storage dtype), "<parameter name>": a copy of each of `parameters` in its own dtype,
    this process's part of it (`distributed.local`)}."""
    names = {id(p): name for name, p in student.named_parameters()}
    state = {name + ".codes": pack_codes(layer.codes, layer.nbits).cpu() for name, layer in pv_linears(student).items()}
    state.update({names[id(p)]: local(p.detach()).to("cpu", copy=True) for p in parameters})
    return state


@torch.no_grad()
def restore(student: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put a `snapshot` back (the straight-through weights are reset to the restored weights)."""
    parameters = dict(student.named_parameters())
    for name, layer in pv_linears(student).items():
        layer.codes.copy_(unpack_codes(state[name + ".codes"], layer.nbits))
    for name, value in state.items():
        if not name.endswith(".codes"):
            local(parameters[name]).copy_(value)
    for layer in pv_linears(student).values():
        if layer.straight_through is not None:
            layer.straight_through.copy_(layer.dequantized_rows())


def set_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute each decoder block in the backward pass instead of keeping its activations
    (transformers >= 5.x names it activation checkpointing, older versions gradient checkpointing)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if enabled:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


@dataclass
class Roots:
    """The student and teacher as the loop runs them (`distill`), sharded by FSDP2 over several processes."""

    student: StudentKL
    teacher: TeacherHidden
    sharded: bool = False

    def teacher_whole(self) -> None:
        """Gather the teacher's root unit (embeddings, final norm, head) where it is sharded: the
        head is read outside the teacher's forward."""
        if self.sharded:
            self.teacher.unshard()

    def teacher_sharded(self) -> None:
        if self.sharded:
            self.teacher.reshard()

    def student_sharded(self) -> None:
        """Shard the student's root unit again after a forward pass without backward (FSDP2 keeps
        a root whole after its forward; until resharded, its modules hold other parameter objects)."""
        if self.sharded:
            self.student.reshard()


def roots(student: nn.Module, teacher: nn.Module) -> Roots:
    """`Roots` of two models, or of roots already made (held-out evaluation of the loop's own)."""
    if isinstance(student, StudentKL):
        return Roots(student, teacher, sharded=hasattr(student, "unshard"))
    return Roots(StudentKL(student), TeacherHidden(teacher))


def shard(pair: Roots, layers: list[PVLinear], device: torch.device) -> Roots:
    """FSDP2 over every process of both models (the quantized layers' codebooks, scales and
    straight-through rows left to `distributed`)."""
    ignored = [p for layer in layers for p in (layer.codebooks, layer.scales, layer.straight_through) if p is not None]
    shard_over_processes(pair.student, pair.student.model, ignored, device)
    shard_over_processes(pair.teacher, pair.teacher.model, [], device)
    pair.sharded = True
    return pair


# --- one step ------------------------------------------------------------------------------------

def _autocast(device: torch.device, amp_dtype: str | None):
    if amp_dtype is None or device.type == "cpu":
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, amp_dtype))


def micro_batch_kl(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor, settings: PVSettings,
                   device: torch.device) -> torch.Tensor:
    """Summed token KL(teacher || student) of input_ids [B, T] int64 on `device`: a scalar float32,
    differentiable in the student (nats summed over the B * T positions). student and teacher:
    the models, or the loop's `Roots` members."""
    pair = roots(student, teacher)
    with _autocast(device, settings.amp_dtype):
        with torch.no_grad():
            teacher_hidden = pair.teacher(input_ids)
        return pair.student(input_ids, teacher_hidden, pair.teacher.model, settings.kl_chunk_tokens)


def windows_that_fit(available: int, gradients: int, moments: int, reserved: int, per_window: int, most: int) -> int:
    """Windows per forward pass within `available` bytes once the gradients, the optimisers'
    moments, a `reserved` budget and 10 % of what is left are set aside, at most `most`; 0 where
    not even one window of `per_window` bytes fits."""
    budget = 0.9 * (available - gradients - moments - reserved)
    return int(min(most, max(budget, 0) // max(per_window, 1)))


def memory_warning(available: int, gradients: int, moments: int, per_window: int, window_tokens: int) -> str:
    """What the micro-batch probe says when not even one window fits, with what would help."""
    gib = 2.0**30
    left = max(0.0, available - gradients - moments) / gib
    return (f"warning: PV-tuning does not fit this card: after the models, their gradients ({gradients / gib:.1f} GiB) "
            f"and the optimisers' moments ({moments / gib:.1f} GiB), {left:.1f} GiB are left and one window of "
            f"{window_tokens} tokens needs {per_window / gib:.1f} GiB (plus 10 % and the V-step's search budget); "
            f"expect an out-of-memory error at the first step. What helps: a card with more memory (every process "
            f"of a torchrun holds all of it), pvtune.code_beta1: 0 (the V-step then keeps no first moment), "
            f"pvtune.update_non_quantized: false, or a shorter pvtune.window_tokens")


def _window_peak(pair: Roots, window: torch.Tensor, settings: PVSettings, device: torch.device,
                 layers: list[PVLinear], trainable: list[nn.Parameter]) -> tuple[int, int]:
    """(bytes of gradients one window's forward/backward leaves, its activations' peak bytes):
    one pass on window [1, T], measured on the card; the gradients are discarded. Weights the
    pass dequantized and kept (`keep_weight`) count as held, like those kept before it: they stay
    allocated, so the caller's free memory already lacks them."""
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - kept_weight_bytes(layers)
    torch.cuda.reset_peak_memory_stats(device)
    open_weight_gradients(layers)
    micro_batch_kl(pair.student, pair.teacher, window.to(device), settings, device).backward()
    close_weight_gradients(layers)
    pair.teacher_sharded()
    torch.cuda.synchronize(device)
    kept = kept_weight_bytes(layers)
    gradients = torch.cuda.memory_allocated(device) - kept - held
    activations = max(torch.cuda.max_memory_allocated(device) - kept - held - gradients, 1)
    for parameter in trainable:
        parameter.grad = None
    for layer in layers:
        if layer.device_gradient is not None:
            layer.device_gradient.zero_()
    return gradients, activations


def moment_bytes(p_params: list[nn.Parameter], v_params: list[nn.Parameter], settings: PVSettings,
                 moments_on_host: list[nn.Parameter] = ()) -> int:
    """Bytes the optimisers' moments will take on the card (allocated at the first step): two per
    P-step parameter except `moments_on_host` (`HostMomentsAdam`), one or two per V-step weight
    on the card (`vstep_adam`; none where the V-step's state is in host memory)."""
    hosted = {id(p) for p in moments_on_host}
    v_moments = state_bytes_per_parameter_byte(settings.code_beta1)
    return (sum(2 * local(p).numel() * p.element_size() for p in p_params if id(p) not in hosted)
            + sum(v_moments * p.numel() * p.element_size() for p in v_params if p.device.type == "cuda"))


def keeping_weights(layers: list[PVLinear], settings: PVSettings, device: torch.device, pending: int = 0) -> bool:
    """Whether to keep the layers' dequantized weights between optimiser steps (`PVLinear.keep_weight`):
    as set, or with "auto" on a GPU whose free memory, less the `pending` bytes the first step
    will allocate (gradients and moments), is at least twice what they take (the rest is for
    activations: the micro-batch probe measures beside them)."""
    if settings.keep_weights != "auto":
        return settings.keep_weights == "always"
    if device.type != "cuda":
        return False
    itemsize = torch.finfo(getattr(torch, settings.amp_dtype)).bits // 8 if settings.amp_dtype else 4
    needed = sum(layer.out_features * layer.in_features for layer in layers) * itemsize
    return _agreed_minimum(int(torch.cuda.mem_get_info(device)[0] - pending >= 2 * needed), device) == 1


def kept_weight_bytes(layers: list[PVLinear]) -> int:
    """Bytes of the dequantized weights the layers keep (`PVLinear.keep_weight`)."""
    return sum(layer.weight_cache.numel() * layer.weight_cache.element_size() for layer in layers
               if layer.weight_cache is not None)


def forget_weights(layers: list[PVLinear]) -> None:
    for layer in layers:
        layer.forget_weight()


def _agreed_minimum(value: int, device: torch.device) -> int:
    """The smallest of every process's `value` (each process's own where there is one)."""
    if world()[1] == 1:
        return value
    agreed = torch.tensor(value, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def choose_micro_batch_size(student: nn.Module, teacher: nn.Module, window: torch.Tensor, settings: PVSettings,
                            device: torch.device, p_params: list[nn.Parameter], v_params: list[nn.Parameter],
                            layers: list[PVLinear] | None = None,
                            moments_on_host: list[nn.Parameter] = ()) -> tuple[int, bool]:
    """(the most windows per micro-batch that fit the card, whether to recompute activations),
    from one measured window.

    window [1, T] int64. Runs one forward/backward (gradients discarded) and measures its peak memory
    over what the models hold; the gradients it leaves and the optimisers' moments (not yet
    allocated before the first step: two per P-step parameter, one or two per V-step weight,
    `vstep_adam`, none on the card where the V-step's state is in host memory, nor for
    `moments_on_host`, `HostMomentsAdam`) are reserved, and
    so are the V-step's beam-search budget and 10 % of the rest. With gradient_checkpointing
    "auto" the window is measured without recomputation first, and recomputation is chosen only
    where that window does not fit. Capped at this process's share of a batch; (1, as set) on a
    CPU. Where not even one window fits, says so on stderr (the first step will run out of
    memory) with what would help. Every process takes the same choice (the smallest card decides).
    """
    pair = roots(student, teacher)
    layers = layers if layers is not None else list(pv_linears(pair.student.model).values())
    size = world()[1]
    most = max(1, math.ceil(settings.batch_size / size))
    if device.type != "cuda":
        return 1, settings.gradient_checkpointing != "never"
    moments = moment_bytes(p_params, v_params, settings, moments_on_host)

    def fitting(checkpointing: bool) -> int:
        set_checkpointing(pair.student.model, checkpointing)
        try:
            gradients, activations = _window_peak(pair, window, settings, device, layers, p_params + v_params)
        except torch.OutOfMemoryError:
            gradients, activations = 0, None
        if activations is None:  # past the except block, the failed pass's tensors are released
            for layer in layers:
                layer.weight_gradient, layer.reducer = None, None
            for parameter in p_params + v_params:
                parameter.grad = None
            torch.cuda.empty_cache()
            return 0
        free, _ = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        chosen = windows_that_fit(free + reusable, gradients, moments, settings.beam_memory_budget_bytes, activations,
                                  most)
        if chosen == 0 and checkpointing:
            print(memory_warning(free + reusable, gradients, moments, activations, window.shape[1]), file=sys.stderr,
                  flush=True)
        return chosen

    checkpointing = settings.gradient_checkpointing == "always"
    chosen = _agreed_minimum(fitting(checkpointing), device)
    if chosen == 0 and settings.gradient_checkpointing == "auto":
        checkpointing = True
        chosen = _agreed_minimum(fitting(True), device)
    set_checkpointing(pair.student.model, checkpointing)
    return max(chosen, 1), checkpointing


@contextmanager
def tf32_matmuls(device: torch.device) -> Iterator[None]:
    """Let float32 matmuls on a GPU use TF32 (what stays float32 under autocast: the KL's
    log-softmax inputs are float32 already, the head and blocks run in the autocast dtype)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def rank_batches(count: int, batch: int, rank: int, size: int) -> list[slice | None]:
    """This process's batches of `count` items taken `batch` at a time round-robin over `size`
    processes (r, r + size, ...), padded with None so that every process has as many: each
    batch runs collectives (FSDP's gathers), which every process must enter alike."""
    starts = list(range(0, count, batch))
    rounds = math.ceil(len(starts) / size)
    mine = starts[rank::size]
    return [slice(start, min(start + batch, count)) for start in mine] + [None] * (rounds - len(mine))


class TeacherCache:
    """The teacher's final hidden states of this process's held-out batches, [b, T, d] each, kept
    in host memory after the first evaluation (the teacher never changes)."""

    def __init__(self):
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, rows: tuple[int, int], make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
        """The hidden states of held-out windows [start, stop) on `device`: made by `make()` the
        first time, kept after (a micro-batch size changed since makes them anew)."""
        if rows in self.hidden:
            return self.hidden[rows].to(device, non_blocking=True)
        made = make()
        host = made.to("cpu", copy=True)
        self.hidden[rows] = host.pin_memory() if made.is_cuda else host
        return made


@torch.no_grad()
def heldout_metrics(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, settings: PVSettings,
                    device: torch.device, cache: TeacherCache | None = None) -> dict[str, float]:
    """Mean token KL and perplexity of the student on held-out windows [n, T] int64 (any device;
    sharded over processes): {"kl": nats per token, "perplexity": exp(mean next-token NLL)}.
    student and teacher: the models, or the loop's `Roots` members; cache: the teacher's hidden
    states of earlier evaluations (`TeacherCache`)."""
    pair = roots(student, teacher)
    rank, size = world()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # KL nats, NLL nats, predicted tokens, tokens
    was_training = pair.student.model.training
    pair.student.model.eval()
    # no gradient, no activations kept: a GPU takes more windows a pass than a training micro-batch
    step = max(settings.micro_batch_size, HELDOUT_WINDOWS_PER_PASS if device.type == "cuda" else 1)
    for part in rank_batches(windows.shape[0], step, rank, size):
        padding = part is None  # a process without windows left runs its collectives all the same
        part = part if part is not None else slice(0, 1)
        input_ids = windows[part].to(device)
        with _autocast(device, settings.amp_dtype):
            make = lambda: pair.teacher(input_ids)  # noqa: E731
            teacher_hidden = make() if cache is None else cache.get((part.start, part.stop), make, device)
            pair.teacher_whole()
            kl, nll = pair.student(input_ids, teacher_hidden, pair.teacher.model, settings.kl_chunk_tokens,
                                   with_nll=True)
            pair.teacher_sharded()
        if padding:  # the collectives ran, nothing is counted
            continue
        totals[0] += kl.double()
        totals[1] += nll
        totals[2] += input_ids[:, 1:].numel()
        totals[3] += input_ids.numel()  # the KL scores every position, the NLL all but the last
    pair.student.model.train(was_training)
    pair.student_sharded()
    all_reduce_sum(totals)
    return {"kl": totals[0].item() / totals[3].item(), "perplexity": math.exp(totals[1].item() / totals[2].item())}


def plateau_reached(values: list[float], evaluations: int | None, min_improvement: float) -> bool:
    """Whether the last `evaluations` of the held-out `values` (in order, lower is better) have
    all failed to lower the best value before them by `min_improvement` of it (relative); never
    where `evaluations` is None or fewer than evaluations + 1 values exist."""
    if evaluations is None or len(values) <= evaluations:
        return False
    best = min(values[:-evaluations])
    return min(values[-evaluations:]) > best * (1 - min_improvement)


# --- the loop ------------------------------------------------------------------------------------

def batch_gradients(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, batch: torch.Tensor,
                    settings: PVSettings, device: torch.device, layers: list[PVLinear],
                    reducer: RowReducer | None = None) -> torch.Tensor:
    """This process's micro-batches of one batch forward and backward: the gradient of the batch's
    mean token KL added into every trainable .grad (the quantized layers' through their weight
    gradients, summed over processes by `reducer`). train_windows [n, T] int64, batch [b] int64
    indices into it; returns this process's KL sum, a float64 scalar on `device`."""
    pair = roots(student, teacher)
    rank, size = world()
    batch_tokens = batch.numel() * train_windows.shape[1]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    open_weight_gradients(layers, reducer)
    for part in rank_batches(batch.numel(), settings.micro_batch_size, rank, size):
        windows = train_windows[batch[part if part is not None else slice(0, 1)]].to(device)
        kl = micro_batch_kl(pair.student, pair.teacher, windows, settings, device)
        # padding (a process without windows left): its passes' collectives run, its gradient is zero
        (kl * (1.0 / batch_tokens if part is not None else 0.0)).backward()
        pair.teacher_sharded()
        if part is not None:
            loss_sum += kl.detach().double()
    close_weight_gradients(layers)
    return loss_sum


def gradients_within_memory(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, batch: torch.Tensor,
                            settings: PVSettings, device: torch.device, layers: list[PVLinear],
                            trainable: list[nn.Parameter], step: int,
                            reducer: RowReducer | None = None) -> tuple[torch.Tensor, PVSettings]:
    """`batch_gradients`, redone while a pass runs out of memory with half the windows per forward
    pass, and at one window, where activations were kept, with them recomputed (settings'
    gradient_checkpointing "never" -> "always"; one process only: processes would disagree).
    Returns the KL sum and the settings that worked."""
    while True:
        try:
            return batch_gradients(student, teacher, train_windows, batch, settings, device, layers, reducer), settings
        except torch.OutOfMemoryError:
            if world()[1] > 1 or (settings.micro_batch_size == 1 and settings.gradient_checkpointing != "never"):
                raise
        # here, past the except block, the failed pass's tensors are no longer referenced
        discard_gradients(layers, trainable, device)
        if settings.micro_batch_size > 1:
            settings = replace(settings, micro_batch_size=settings.micro_batch_size // 2)
            change = f"with {settings.micro_batch_size} windows per forward pass"
        else:
            settings = replace(settings, gradient_checkpointing="always")
            set_checkpointing(roots(student, teacher).student.model, True)
            change = "recomputing activations in the backward pass"
        print(f"pv-tune: out of memory at step {step}; the step is redone {change}", file=sys.stderr, flush=True)


def discard_gradients(layers: list[PVLinear], parameters: list[nn.Parameter], device: torch.device) -> None:
    """Drop what a failed forward/backward pass left: the layers' open weight gradients, every
    parameter's .grad and, on a GPU, the allocator's cached blocks."""
    for layer in layers:
        layer.weight_gradient, layer.reducer = None, None
        if layer.device_gradient is not None:
            layer.device_gradient.zero_()
    for parameter in parameters:
        parameter.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def _timed(timings: dict[str, float], key: str, device: torch.device) -> Iterator[None]:
    started = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - started


def batches_per_epoch(num_windows: int, batch_size: int) -> int:
    return math.ceil(num_windows / batch_size)


def train(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, heldout_windows: torch.Tensor,
          settings: PVSettings, device: str | torch.device, progress: bool = True,
          on_eval: Callable[[dict], None] | None = None, resumer: Resumer | None = None) -> TrainResult:
    """PV-tune `student` against `teacher` in place; the student ends in its best held-out state
    (over several processes sharded by FSDP2, and gathered whole in the result's `student_state`).

    train_windows [n, T] int64, heldout_windows [h, T] int64 (on any device). resumer: where the
    loop's full state is saved every few steps and resumed from (`aqflow.pvtune.resume`).
    """
    device = torch.device(device)
    with tf32_matmuls(device):
        return _train(student, teacher, train_windows, heldout_windows, settings, device, progress, on_eval, resumer)


def _fusable(params: list[torch.Tensor]) -> bool | None:
    """True where Adam's fused kernel can update these in place (plain tensors on a GPU): the default
    multi-tensor path allocates a copy of the moments for each step's arithmetic, GiBs for an 8B's
    embedding and head, which ran a one-card 8B out of memory. None (torch's default) elsewhere."""
    from torch.distributed.tensor import DTensor  # FSDP2's shards keep torch's default

    return True if all(p.device.type == "cuda" and not isinstance(p, DTensor) for p in params) else None


def _optimizers(trainable: Trainable, layers: list[PVLinear], settings: PVSettings) -> dict:
    """The loop's optimisers: "p" Adam on the non-quantized parameters, "q" Adam on codebooks and
    scales (separate: over several processes the former are FSDP2's sharded tensors, the latter
    whole), "v" the V-step's (`HostVStep` where its state is in host memory); None where unused."""
    betas = (settings.adam_beta1, settings.adam_beta2)
    adam = lambda params: (torch.optim.Adam(params, lr=settings.lr, betas=betas,  # noqa: E731
                                            fused=_fusable(params)) if params else None)
    # with the V-step's state on the host (a card too small), the non-quantized parameters' moments join it
    p_adam = (lambda params: HostMomentsAdam(params, lr=settings.lr, betas=betas, fused=_fusable(params))  # noqa: E731
              if params else None) if settings.v_state == "host" else adam
    with_v = [layer for layer in layers if layer.straight_through is not None] if settings.update_codes else []
    groups = v_step_param_groups([layer.straight_through for layer in with_v], settings.code_lr, settings.code_lr_scale,
                                 [layer.weight_rms() for layer in with_v])
    if not with_v:
        v_optimizer = None
    elif settings.v_state == "host":
        v_optimizer = HostVStep(groups, with_v, settings.code_beta1, settings.code_beta2,
                                settings.max_code_change_fraction, settings.code_beam_size,
                                settings.beam_memory_budget_bytes)
    else:
        v_optimizer = v_step_optimizer(groups, settings.code_beta1, settings.code_beta2)
    return {"p": p_adam(trainable.non_quantized), "q": adam(trainable.quantized), "v": v_optimizer}


def _prepare(student: nn.Module, teacher: nn.Module, settings: PVSettings,
             device: torch.device) -> tuple[Roots, Trainable, list[PVLinear]]:
    """The loop's roots, trainable parameters and quantized layers: the straight-through rows made
    (in host memory with v_state "host", `trainable_groups`), and over several processes both
    models sharded."""
    size = world()[1]
    if settings.v_state == "host" and size > 1:
        raise ValueError("v_state 'host' (the V-step's state in host memory) runs in one process only")
    layers = list(pv_linears(student).values())
    trainable = trainable_groups(student, settings)
    pair = roots(student, teacher)
    if size > 1:
        shard(pair, layers, device)
        trainable = trainable_groups(student, settings)  # FSDP2 replaced the parameters by sharded ones
    return pair, trainable, layers


def _train(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, heldout_windows: torch.Tensor,
           settings: PVSettings, device: torch.device, progress: bool,
           on_eval: Callable[[dict], None] | None, resumer: Resumer | None) -> TrainResult:
    rank, size = world()
    if settings.micro_batch_size * size > settings.batch_size:
        raise ValueError(f"batch_size {settings.batch_size} is smaller than micro_batch_size "
                         f"{settings.micro_batch_size} x {size} processes")
    pair, trainable, layers = _prepare(student, teacher, settings, device)
    optimizers = _optimizers(trainable, layers, settings)
    blocks_path = decoder_block_path(teacher) if compiling(settings.compile_blocks, device, size) else None
    if blocks_path is not None:  # before the probe, which then measures the compiled blocks' memory
        compile_blocks(student, blocks_path)
        compile_blocks(teacher, blocks_path)
        pair.student.chunk_kernel = kl_kernel()
    all_trainable = trainable.non_quantized + trainable.quantized + trainable.straight_through
    p_params = trainable.non_quantized + trainable.quantized
    student.train()
    teacher.eval()

    timings: dict[str, float] = {}
    moments_on_host = trainable.non_quantized if settings.v_state == "host" else []
    pending = (moment_bytes(p_params, trainable.straight_through, settings, moments_on_host)
               + sum(local(p).numel() * p.element_size() for p in p_params + trainable.straight_through
                     if p.device.type == device.type))  # and the gradients
    keep = keeping_weights(layers, settings, device, pending)
    for layer in layers:
        layer.keep_weight = keep
    checkpointing = settings.gradient_checkpointing != "never"
    set_checkpointing(student, checkpointing)
    if settings.micro_batch_size == 0:
        with _timed(timings, "micro_batch_probe_seconds", device):
            chosen, checkpointing = choose_micro_batch_size(pair.student, pair.teacher, train_windows[:1], settings,
                                                            device, p_params, trainable.straight_through, layers,
                                                            moments_on_host)
            settings = replace(settings, micro_batch_size=chosen)
    # what the loop does from here on (an out-of-memory step may switch recomputation on)
    settings = replace(settings, gradient_checkpointing="always" if checkpointing else "never")
    log: list[dict] = []
    started = time.perf_counter()
    steps_per_epoch = batches_per_epoch(train_windows.shape[0], settings.batch_size)
    budget_steps = settings.epochs * steps_per_epoch
    if settings.max_steps is not None:
        budget_steps = min(budget_steps, settings.max_steps)
    total_steps = budget_steps
    total_groups = sum(layer.codes.shape[0] * layer.codes.shape[1] for layer in layers)
    v_step = VStep(layers, settings.max_code_change_fraction, settings.code_beam_size,
                   settings.beam_memory_budget_bytes, use_graph=settings.v_step_graph)
    reducer = RowReducer()
    cache = TeacherCache()
    state_bytes = 0

    def evaluate(step: int, epoch: float) -> dict:
        with _timed(timings, "heldout_eval_seconds", device):
            metrics = heldout_metrics(pair.student, pair.teacher, heldout_windows, settings, device, cache)
        row = {"step": step, "epoch": epoch, "split": "heldout", "kl": metrics["kl"], "perplexity": metrics["perplexity"],
               "codes_changed_fraction": float("nan"), "seconds": time.perf_counter() - started}
        log.append(row)
        if on_eval is not None:
            on_eval(row)
        return row

    def plateaued() -> bool:
        values = [row[metric] for row in log if row["split"] == "heldout"]
        return plateau_reached(values, settings.plateau_evaluations, settings.plateau_min_improvement)

    metric = settings.selection_metric
    generator = torch.Generator().manual_seed(settings.seed)
    resumed = resumer.load(student, optimizers) if resumer is not None else None
    forget_weights(layers)  # the probe's, or made before the resumed state was loaded
    if resumed is None:
        best = initial = evaluate(0, 0.0)
        best_state = snapshot(student, p_params)
        step, order, first = 0, None, 0
    else:
        log[:], best, initial, best_state = resumed.log, resumed.best, resumed.initial, resumed.best_state
        step, order, first = resumed.step, resumed.order, resumed.next_batch
        generator.set_state(resumed.generator_state)
        started -= resumed.elapsed_seconds
        timings.update(resumed.timings)
    stopped_at_plateau = plateaued()
    if stopped_at_plateau:
        total_steps = step
    bar = tqdm(total=total_steps, initial=step, desc="pv-tune", unit="step", disable=not progress or rank != 0)
    while step < total_steps:
        if order is None:
            order, first = torch.randperm(train_windows.shape[0], generator=generator), 0
        while first < len(order) and step < total_steps:
            batch = order[first:first + settings.batch_size]
            first += settings.batch_size
            batch_tokens = batch.numel() * train_windows.shape[1]
            with _timed(timings, "forward_backward_seconds", device):
                loss_sum, settings = gradients_within_memory(pair.student, pair.teacher, train_windows, batch, settings,
                                                             device, layers, all_trainable, step + 1, reducer)
                checkpointing = settings.gradient_checkpointing == "always"
                all_reduce_sum(loss_sum)
            if step < 2:  # with the gradients, and (from the second step) every optimiser moment
                state_bytes = max(state_bytes, held_bytes([student, teacher], optimizers.values()))
            with _timed(timings, "p_step_seconds", device):
                for key in ("p", "q"):
                    if optimizers[key] is not None:
                        optimizers[key].step()
                        optimizers[key].zero_grad(set_to_none=True)
            changed = 0
            with _timed(timings, "v_step_seconds", device):
                if isinstance(optimizers["v"], HostVStep):
                    changed = optimizers["v"].step()
                elif optimizers["v"] is not None:
                    optimizers["v"].step()
                    optimizers["v"].zero_grad(set_to_none=True)
                    changed = v_step()
            forget_weights(layers)  # codebooks, scales and codes have moved
            step += 1
            epoch = step / steps_per_epoch
            log.append({"step": step, "epoch": epoch, "split": "train", "kl": loss_sum.item() / batch_tokens,
                        "perplexity": float("nan"), "codes_changed_fraction": changed / total_groups,
                        "seconds": time.perf_counter() - started})
            bar.update(1)
            bar.set_postfix(kl=f"{log[-1]['kl']:.4f}", codes=f"{changed / total_groups:.2%}")
            if step % settings.eval_every_steps == 0 or step == total_steps:
                row = evaluate(step, epoch)
                if row[metric] < best[metric]:
                    best = row
                    best_state = snapshot(student, p_params)
                if plateaued():
                    stopped_at_plateau, total_steps = step < budget_steps, step
            if resumer is not None and resumer.due(step, total_steps):
                resumer.save(student, optimizers, LoopState(
                    step=step, order=order if first < len(order) else None, next_batch=first,
                    generator_state=generator.get_state(), log=log, initial=initial, best=best,
                    best_state=best_state, elapsed_seconds=time.perf_counter() - started, timings=timings))
        order = None
    bar.close()
    if stopped_at_plateau and progress and rank == 0:
        print(f"pv-tune: held-out {metric} no better by {settings.plateau_min_improvement:.1%} over the last "
              f"{settings.plateau_evaluations} evaluations; stopped after step {step} of {budget_steps}", flush=True)
    set_checkpointing(student, False)
    if blocks_path is not None:
        uncompile_blocks(student, blocks_path)
        uncompile_blocks(teacher, blocks_path)
    for layer in layers:
        layer.keep_weight = False
    forget_weights(layers)
    restore(student, best_state)
    student_state = gathered_state(student) if pair.sharded else None
    student.eval()
    timings["train_seconds"] = time.perf_counter() - started
    return TrainResult(log=log, best_step=best["step"], best_heldout=best, initial_heldout=initial, steps=step,
                       micro_batch_size=settings.micro_batch_size, timings=timings,
                       gradient_checkpointing=checkpointing, stopped_at_plateau=stopped_at_plateau,
                       budget_steps=budget_steps, state_bytes=state_bytes, student_state=student_state,
                       compiled_blocks=blocks_path is not None)


def settings_record(settings: PVSettings) -> dict:
    return asdict(settings)
