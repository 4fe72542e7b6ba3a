"""The PV-tuning loop: KL(teacher || student) on calibration windows, P-step and V-step per step,
held-out evaluation and selection of the best held-out state.

One optimiser step consumes `batch_size` windows, split into micro-batches of
`micro_batch_size` (and, under torch.distributed, over processes: process r takes the
micro-batches r, r + world, ...). Each micro-batch's KL sum is divided by the token count of the
whole batch, so the accumulated and all-reduced gradient is that of the batch's mean token KL.
`micro_batch_size: 0` picks the largest micro-batch the card's free memory allows, measured on
one window before training (`choose_micro_batch_size`; 1 on a CPU); a step that still runs out
of memory is redone with half as many (one process; `batch_gradients`). The quantized layers'
dL/dW is summed over the micro-batches and pushed into codebooks and scales once per step
(`student.open_weight_gradients`). On a GPU, float32 matmuls outside autocast may use TF32.
Then:

* P-step: Adam on codebooks, scales and, optionally, every non-quantized parameter (norms,
  embeddings, head, biases).
* V-step: Adam on each layer's straight-through weight (its gradient is dL/dW; with beta1 = 0
  one that keeps no first moment, `vstep_adam`), then the codes
  are re-encoded toward it (`vstep.v_step_layer`), at most `max_code_change_fraction` of each
  layer's groups per step. The codes are integer buffers: nothing else ever writes them.

The held-out windows (calibration documents the training never sees) are scored before the
first step, every `eval_every_steps` steps and after the last; the state with the lowest
held-out `selection_metric` (the training loss, "kl", by default; or "perplexity"; step 0
included) is kept in CPU memory and restored at the end.
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
from .loss import chunked_kl_sum, chunked_nll_sum, final_hidden
from .resume import LoopState, Resumer
from .student import PVLinear, close_weight_gradients, open_weight_gradients, pv_linears
from .vstep import DEFAULT_MEMORY_BUDGET_BYTES, VStep
from .vstep_adam import state_bytes_per_parameter_byte, v_step_optimizer

SELECTION_METRICS = ("kl", "perplexity")
CODE_LR_SCALES = ("absolute", "weight_rms")


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
    gradient_checkpointing: bool = True
    # autocast dtype on the accelerator ("bfloat16"), None: float32 (the pvtune stage resolves it
    # from its own --amp-dtype, so it is no command-line option of its own)
    amp_dtype: str | None = field(default=None, metadata={"cli": False})
    seed: int = 0
    selection_metric: str = field(default="kl", metadata={"choices": SELECTION_METRICS,
                                                          "help": "held-out metric that selects the state written out"})
    beam_memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    v_step_graph: bool = True  # on a GPU, replay the V-step of all layers as one CUDA graph

    def __post_init__(self):
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


# --- distributed ---------------------------------------------------------------------------------

def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over processes, in place (a no-op in a single process); any shape and dtype, returned as given."""
    if world()[1] > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


# --- parameters ----------------------------------------------------------------------------------

def v_step_param_groups(weights: list[nn.Parameter], code_lr: float, scale: str) -> list[dict]:
    """The V-step optimiser's parameter groups: one group of every straight-through weight
    [out, in] at `code_lr` ("absolute"), or one group per weight at code_lr x its RMS ("weight_rms")."""
    if scale == "absolute":
        return [{"params": list(weights), "lr": code_lr}]
    if scale != "weight_rms":
        raise ValueError(f"code_lr_scale must be one of {CODE_LR_SCALES}, got {scale!r}")
    return [{"params": [weight], "lr": code_lr * float(weight.detach().float().square().mean().sqrt())}
            for weight in weights]


def trainable_groups(student: nn.Module, settings: PVSettings) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(P-step parameters, V-step straight-through parameters); sets requires_grad accordingly.

    P-step: every layer's codebooks [M, K, g] and scales [out] float32, and, with
    `update_non_quantized`, every other parameter once (tied ones once); V-step: every layer's
    straight-through weight [out, in] float32 (created here where missing).
    """
    layers = pv_linears(student)
    if not layers:
        raise ValueError("the student has no quantized linears (PVLinear)")
    student.requires_grad_(False)
    quantized_ids = set()
    p_params, v_params = [], []
    for layer in layers.values():
        if settings.update_codes and layer.straight_through is None:
            layer.enable_straight_through()
        quantized_ids.update(id(p) for p in (layer.codebooks, layer.scales))
        if settings.update_codebooks_and_scales:
            p_params += [layer.codebooks, layer.scales]
        if settings.update_codes:
            v_params.append(layer.straight_through)
        if layer.straight_through is not None:
            quantized_ids.add(id(layer.straight_through))
    if settings.update_non_quantized:
        seen = set(quantized_ids)
        for parameter in student.parameters():  # deduplicated: tied embeddings appear once
            if id(parameter) not in seen:
                seen.add(id(parameter))
                p_params.append(parameter)
    for parameter in p_params + v_params:
        parameter.requires_grad_(True)
    return p_params, v_params


def snapshot(student: nn.Module, parameters: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    """CPU copy of everything training changes: {"<layer>.codes": [out, G, M] packed int8/int16
    (the AQLM storage dtype), "<parameter name>": a copy of each of `parameters` in its own shape and dtype}."""
    names = {id(p): name for name, p in student.named_parameters()}
    state = {name + ".codes": pack_codes(layer.codes, layer.nbits).cpu() for name, layer in pv_linears(student).items()}
    state.update({names[id(p)]: p.detach().to("cpu", copy=True) for p in parameters})
    return state


@torch.no_grad()
def restore(student: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put a `snapshot` back (the straight-through weights are reset to the restored weights)."""
    parameters = dict(student.named_parameters())
    for name, layer in pv_linears(student).items():
        layer.codes.copy_(unpack_codes(state[name + ".codes"], layer.nbits))
    for name, value in state.items():
        if not name.endswith(".codes"):
            parameters[name].copy_(value)
    for layer in pv_linears(student).values():
        if layer.straight_through is not None:
            layer.straight_through.copy_(layer.dequantized())


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


# --- one step ------------------------------------------------------------------------------------

def _autocast(device: torch.device, amp_dtype: str | None):
    if amp_dtype is None or device.type == "cpu":
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, amp_dtype))


def micro_batch_kl(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor, settings: PVSettings,
                   device: torch.device) -> torch.Tensor:
    """Summed token KL(teacher || student) of input_ids [B, T] int64 on `device`: a scalar float32,
    differentiable in the student (nats summed over the B * T positions)."""
    with _autocast(device, settings.amp_dtype):
        with torch.no_grad():
            teacher_hidden = final_hidden(teacher, input_ids)
        student_hidden = final_hidden(student, input_ids)
        width = student_hidden.shape[-1]
        return chunked_kl_sum(student, teacher, student_hidden.reshape(-1, width),
                              teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), settings.kl_chunk_tokens)


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


def choose_micro_batch_size(student: nn.Module, teacher: nn.Module, window: torch.Tensor, settings: PVSettings,
                            device: torch.device, p_params: list[nn.Parameter], v_params: list[nn.Parameter]) -> int:
    """The most windows per micro-batch that fit the card, from one measured window.

    window [1, T] int64. Runs one forward/backward (gradients discarded) and measures its peak memory
    over what the models hold; the gradients it leaves and the optimisers' moments (not yet
    allocated before the first step: two per P-step parameter, one or two per V-step weight,
    `vstep_adam`) are reserved, and so are the V-step's beam-search budget and 10 % of the rest.
    Capped at this process's share of a batch; 1 on a CPU. Where not even one window fits, says
    so on stderr (the first step will run out of memory) with what would help.
    """
    trainable = p_params + v_params
    size = world()[1]
    most = max(1, math.ceil(settings.batch_size / size))
    if device.type != "cuda":
        return 1
    layers = list(pv_linears(student).values())
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    open_weight_gradients(layers)
    micro_batch_kl(student, teacher, window.to(device), settings, device).backward()
    close_weight_gradients(layers)
    torch.cuda.synchronize(device)
    gradients = torch.cuda.memory_allocated(device) - held
    activations = max(torch.cuda.max_memory_allocated(device) - held - gradients, 1)
    for parameter in trainable:
        parameter.grad = None
    free, _ = torch.cuda.mem_get_info(device)
    reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    v_moments = state_bytes_per_parameter_byte(settings.code_beta1)
    moments = (sum(2 * p.numel() * p.element_size() for p in p_params)
               + sum(v_moments * p.numel() * p.element_size() for p in v_params))
    chosen = windows_that_fit(free + reusable, gradients, moments, settings.beam_memory_budget_bytes, activations, most)
    if chosen == 0:
        print(memory_warning(free + reusable, gradients, moments, activations, window.shape[1]), file=sys.stderr,
              flush=True)
        chosen = 1
    if size > 1:  # every process takes the same size (the smallest card decides)
        agreed = torch.tensor(chosen, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        chosen = int(agreed.item())
    return chosen


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


@torch.no_grad()
def heldout_metrics(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, settings: PVSettings,
                    device: torch.device) -> dict[str, float]:
    """Mean token KL and perplexity of the student on held-out windows [n, T] int64 (any device;
    sharded over processes): {"kl": nats per token, "perplexity": exp(mean next-token NLL)}."""
    rank, size = world()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # KL nats, NLL nats, predicted tokens, tokens
    was_training = student.training
    student.eval()
    for start in range(rank * settings.micro_batch_size, windows.shape[0], size * settings.micro_batch_size):
        input_ids = windows[start:start + settings.micro_batch_size].to(device)
        with _autocast(device, settings.amp_dtype):
            student_hidden = final_hidden(student, input_ids)
            teacher_hidden = final_hidden(teacher, input_ids)
            width = student_hidden.shape[-1]
            totals[0] += chunked_kl_sum(student, teacher, student_hidden.reshape(-1, width),
                                        teacher_hidden.reshape(-1, width), settings.kl_chunk_tokens).double()
            totals[1] += chunked_nll_sum(student, student_hidden[:, :-1].reshape(-1, width),
                                         input_ids[:, 1:].reshape(-1), settings.kl_chunk_tokens)
        totals[2] += input_ids[:, 1:].numel()
        totals[3] += input_ids.numel()  # the KL scores every position, the NLL all but the last
    student.train(was_training)
    all_reduce_sum(totals)
    return {"kl": totals[0].item() / totals[3].item(), "perplexity": math.exp(totals[1].item() / totals[2].item())}


def _average_gradients(parameters: list[nn.Parameter]) -> None:
    """Sum the .grad of every parameter (its own shape, float32) over processes, in place (each
    micro-batch loss is already divided by the batch's tokens); a missing .grad counts as zeros."""
    if world()[1] == 1:
        return
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)


# --- the loop ------------------------------------------------------------------------------------

def batch_gradients(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, batch: torch.Tensor,
                    settings: PVSettings, device: torch.device, layers: list[PVLinear]) -> torch.Tensor:
    """This process's micro-batches of one batch forward and backward: the gradient of the batch's
    mean token KL added into every trainable .grad (the quantized layers' through their weight
    gradients). train_windows [n, T] int64, batch [b] int64 indices into it; returns this process's
    KL sum, a float64 scalar on `device`."""
    rank, size = world()
    batch_tokens = batch.numel() * train_windows.shape[1]
    step = settings.micro_batch_size
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    open_weight_gradients(layers)
    for first in range(rank * step, batch.numel(), size * step):
        kl = micro_batch_kl(student, teacher, train_windows[batch[first:first + step]].to(device), settings, device)
        (kl / batch_tokens).backward()
        loss_sum += kl.detach().double()
    close_weight_gradients(layers)
    return loss_sum


def gradients_within_memory(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, batch: torch.Tensor,
                            settings: PVSettings, device: torch.device, layers: list[PVLinear],
                            trainable: list[nn.Parameter], step: int) -> tuple[torch.Tensor, PVSettings]:
    """`batch_gradients`, redone with half the windows per forward pass while a pass runs out of
    memory (one process only: processes would disagree on the micro-batch; one window is the
    floor). Returns the KL sum and the settings with the micro-batch that worked."""
    while True:
        try:
            return batch_gradients(student, teacher, train_windows, batch, settings, device, layers), settings
        except torch.OutOfMemoryError:
            if world()[1] > 1 or settings.micro_batch_size == 1:
                raise
        # here, past the except block, the failed pass's tensors are no longer referenced
        settings = replace(settings, micro_batch_size=settings.micro_batch_size // 2)
        discard_gradients(layers, trainable, device)
        print(f"pv-tune: out of memory at step {step}; the step is redone with {settings.micro_batch_size} windows "
              f"per forward pass", file=sys.stderr, flush=True)


def discard_gradients(layers: list[PVLinear], parameters: list[nn.Parameter], device: torch.device) -> None:
    """Drop what a failed forward/backward pass left: the layers' open weight gradients, every
    parameter's .grad and, on a GPU, the allocator's cached blocks."""
    for layer in layers:
        layer.weight_gradient = None
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
    """PV-tune `student` against `teacher` in place; the student ends in its best held-out state.

    train_windows [n, T] int64, heldout_windows [h, T] int64 (on any device). resumer: where the
    loop's full state is saved every few steps and resumed from (`aqflow.pvtune.resume`).
    """
    device = torch.device(device)
    with tf32_matmuls(device):
        return _train(student, teacher, train_windows, heldout_windows, settings, device, progress, on_eval, resumer)


def _train(student: nn.Module, teacher: nn.Module, train_windows: torch.Tensor, heldout_windows: torch.Tensor,
           settings: PVSettings, device: torch.device, progress: bool,
           on_eval: Callable[[dict], None] | None, resumer: Resumer | None) -> TrainResult:
    rank, size = world()
    if settings.micro_batch_size * size > settings.batch_size:
        raise ValueError(f"batch_size {settings.batch_size} is smaller than micro_batch_size "
                         f"{settings.micro_batch_size} x {size} processes")
    p_params, v_params = trainable_groups(student, settings)
    layers = list(pv_linears(student).values())
    p_optimizer = torch.optim.Adam(p_params, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2)) if p_params else None
    v_optimizer = (v_step_optimizer(v_step_param_groups(v_params, settings.code_lr, settings.code_lr_scale),
                                    settings.code_beta1, settings.code_beta2) if v_params else None)
    if settings.gradient_checkpointing:
        set_checkpointing(student, True)
    student.train()
    teacher.eval()

    timings: dict[str, float] = {}
    if settings.micro_batch_size == 0:
        with _timed(timings, "micro_batch_probe_seconds", device):
            settings = replace(settings, micro_batch_size=choose_micro_batch_size(
                student, teacher, train_windows[:1], settings, device, p_params, v_params))
    log: list[dict] = []
    started = time.perf_counter()
    steps_per_epoch = batches_per_epoch(train_windows.shape[0], settings.batch_size)
    total_steps = settings.epochs * steps_per_epoch
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    total_groups = sum(layer.codes.shape[0] * layer.codes.shape[1] for layer in layers)
    v_step = VStep(layers, settings.max_code_change_fraction, settings.code_beam_size,
                   settings.beam_memory_budget_bytes, use_graph=settings.v_step_graph)

    def evaluate(step: int, epoch: float) -> dict:
        with _timed(timings, "heldout_eval_seconds", device):
            metrics = heldout_metrics(student, teacher, heldout_windows, settings, device)
        row = {"step": step, "epoch": epoch, "split": "heldout", "kl": metrics["kl"], "perplexity": metrics["perplexity"],
               "codes_changed_fraction": float("nan"), "seconds": time.perf_counter() - started}
        log.append(row)
        if on_eval is not None:
            on_eval(row)
        return row

    metric = settings.selection_metric
    generator = torch.Generator().manual_seed(settings.seed)
    optimizers = {"p": p_optimizer, "v": v_optimizer}
    resumed = resumer.load(student, optimizers) if resumer is not None else None
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
    bar = tqdm(total=total_steps, initial=step, desc="pv-tune", unit="step", disable=not progress or rank != 0)
    while step < total_steps:
        if order is None:
            order, first = torch.randperm(train_windows.shape[0], generator=generator), 0
        while first < len(order) and step < total_steps:
            batch = order[first:first + settings.batch_size]
            first += settings.batch_size
            batch_tokens = batch.numel() * train_windows.shape[1]
            with _timed(timings, "forward_backward_seconds", device):
                loss_sum, settings = gradients_within_memory(student, teacher, train_windows, batch, settings, device,
                                                             layers, p_params + v_params, step + 1)
                _average_gradients(p_params + v_params)
                all_reduce_sum(loss_sum)
            with _timed(timings, "p_step_seconds", device):
                if p_optimizer is not None:
                    p_optimizer.step()
                    p_optimizer.zero_grad(set_to_none=True)
            changed = 0
            with _timed(timings, "v_step_seconds", device):
                if v_optimizer is not None:
                    v_optimizer.step()
                    v_optimizer.zero_grad(set_to_none=True)
                    changed = v_step()
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
            if resumer is not None and rank == 0 and resumer.due(step, total_steps):
                resumer.save(student, optimizers, LoopState(
                    step=step, order=order if first < len(order) else None, next_batch=first,
                    generator_state=generator.get_state(), log=log, initial=initial, best=best,
                    best_state=best_state, elapsed_seconds=time.perf_counter() - started, timings=timings))
        order = None
    bar.close()
    if settings.gradient_checkpointing:
        set_checkpointing(student, False)
    restore(student, best_state)
    student.eval()
    timings["train_seconds"] = time.perf_counter() - started
    return TrainResult(log=log, best_step=best["step"], best_heldout=best, initial_heldout=initial, steps=step,
                       micro_batch_size=settings.micro_batch_size, timings=timings)


def settings_record(settings: PVSettings) -> dict:
    return asdict(settings)
