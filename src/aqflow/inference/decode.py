"""Batch-1 greedy decoding with a static KV cache: the one harness that times fp and quantized models alike.

On CUDA the decode step (model forward on one token, argmax, the next token and position written back
into the step's own input buffers) is captured once as a CUDA graph and replayed per token, so a
token costs no Python; by default the model forward is `torch.compile`d first (RMSNorm, rotary, residual
adds and casts fused into a few kernels; tens of seconds once per call) and the compiled step captured
the same way, falling back to the plain step where compiling fails. q/k/v and gate/up are fused into
one product each first (`fuse_projections`), on a CPU too, where the step runs eagerly.

`fuse_projections(model)` makes the q/k/v and gate/up projections of the Llama family (Llama,
Mistral, Qwen2) one matrix product each: fewer kernels per token, for dense and quantized layers.

A compiled CUDA step computes its 2-bit GEMVs with open sums (`aqflow.inference.open_sums`): the split-K
kernel leaves scales, bias and cast to the compiled kernel that reads its output (for the fused q/k/v, the
attention's own kernel: `aqflow.inference.cuda_layers`), and the step zeroes the sums after each token.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Iterator, Sequence

import torch

from aqflow.inference.dependent_launch import active as dependent_launch_active
from aqflow.inference.dependent_launch import enabled as dependent_launch_enabled
from aqflow.inference.dependent_launch import supported as dependent_launch_supported
from aqflow.inference.layout import QuantizedWeights
from aqflow.inference.open_sums import StepSums, open_sums_enabled


@dataclass(frozen=True)
class DecodeTimings:
    """prompt_tokens through the model in prefill_seconds (ending with the first new token), then
    timed_steps decode steps (one token in, the next out) in decode_seconds. On CUDA the first
    decode steps warm the kernels and capture the graph (capture_seconds) and are not timed."""

    prompt_tokens: int
    prefill_seconds: float
    new_tokens: int
    decode_seconds: float
    timed_steps: int = 0
    capture_seconds: float = 0.0
    mode: str = "eager"  # eager | graph | compile+graph | compile+eager
    # with profile=True: (kernel name, GPU microseconds) of one decode step as timed (a graph replay)
    step_kernels: tuple[tuple[str, float], ...] = ()
    compile_error: str | None = None
    attention: str = "model's own"  # or decode_attention.IMPLEMENTATION: its one-token kernels decoded
    dependent_launch: bool = False  # kernels launched with programmatic dependent launch
    open_sums: int = 0  # 2-bit linears that computed the decode steps with open sums (open_sums)
    cpu_layers: int = 0  # modules whose one-token forward ran through cpu_layers' kernels (a CPU decode)
    cuda_layers: int = 0  # attention modules that rotated and cached inside the attention kernels (cuda_layers)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.timed_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's input embeddings (where input ids must live)."""
    return model.get_input_embeddings().weight.device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_static_cache(model: torch.nn.Module, max_cache_len: int):
    """A transformers StaticCache sized for max_cache_len tokens (its tensors are allocated on first use)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def step_logits(model, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """token [1, 1], position [1, 1] -> logits [1, vocab] of the next token (the cache takes the token's K/V)."""
    out = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True)
    return out.logits[:, -1, :]


ARGMAX_ROW = 1024  # logits per row of greedy_token's first stage


def greedy_token(logits: torch.Tensor, *, two_stage: bool | None = None) -> torch.Tensor:
    """logits [1, V] -> the index of its largest entry [1] (the first, if several), as logits.argmax(dim=-1)
    gives it. On CUDA (or two_stage=True) in two stages: the maxima of rows of ARGMAX_ROW logits, then the
    first row holding the largest. Why: on a GPU one argmax over a 128K vocabulary is one reduction kernel of
    ~30 us in a compiled decode step (eager or inductor's; Llama-3.2-3B on an H200: ~3 % of the 2-bit step);
    rows reduce in parallel. On a CPU the plain argmax of fp32 logits is the faster (2 cores: 240 against
    540 us at 128K)."""
    if not (logits.is_cuda if two_stage is None else two_stage):
        return logits.reshape(1, -1).argmax(dim=-1)
    flat = logits.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % ARGMAX_ROW), value=float("-inf"))
    row_max, index_in_row = padded.view(-1, ARGMAX_ROW).max(dim=1)
    row = row_max.argmax().view(1)
    # gather, not index_in_row[row]: indexing by a 0-d tensor reads it back to the host (no graph capture)
    return row * ARGMAX_ROW + index_in_row.gather(0, row)


class _DecodeStep:
    """One decode step on fixed buffers, so that it can be captured and replayed: token [1, 1] and
    position [1, 1] in; the argmax token written into token and into generated[position -
    first_position] (generated [new_tokens] int64), position + 1. next_token(token, position) -> the argmax
    token [1] (the model's forward and the argmax: compiled, both are)."""

    def __init__(self, next_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], token: torch.Tensor,
                 position: torch.Tensor, generated: torch.Tensor, first_position: int,
                 sums: StepSums | None = None):
        self.next_token = next_token
        self.token, self.position, self.generated = token, position, generated
        self.first_position = first_position
        self.sums = sums  # open sums: zeroed after every step, for the next

    def __call__(self) -> None:
        chosen = self.next_token(self.token, self.position)  # [1]
        self.generated.index_copy_(0, self.position.reshape(1) - self.first_position, chosen)
        self.token.copy_(chosen.view(1, 1))
        self.position.add_(1)
        if self.sums is not None:
            self.sums.zero()


def profile_kernels(fn: Callable[[], None], device: torch.device) -> list[tuple[str, float]]:
    """(name, GPU microseconds) of every CUDA kernel fn() launches, graph replays included (empty on CPU)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = list(prof.events())
    kernels = [(e.name, e.time_range.elapsed_us()) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:  # older layouts keep kernels only under their launching CPU op
        kernels = [(k.name, k.duration) for e in events for k in getattr(e, "kernels", [])]
    return kernels


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, *,
                  graphs: bool | None = None, on_token: Callable[[int], None] | None = None,
                  compile: bool | None = None, fuse: bool | None = None,
                  stop_tokens: Collection[int] | None = None, warmup_steps: int = 2,
                  profile: bool = False, fast_attention: bool | None = None,
                  dependent_launch: bool | None = None,
                  cpu_layers: bool | None = None, cuda_layers: bool | None = None,
                  open_sums: bool | None = None) -> tuple[torch.Tensor, DecodeTimings]:
    """Greedy decoding of new_tokens tokens after input_ids [1, P] with a static KV cache.

    graphs: capture the decode step as a CUDA graph (default: on CUDA). compile: torch.compile the
    model forward of the step before capturing it (default: with graphs; a compile that fails falls
    back to the plain forward, timings.compile_error says why). fuse: fuse_projections(model) first, in
    place (default: on; logits unchanged but for rounding: on a CPU the fused 2-bit and bf16 products
    are bit-identical to the unfused ones, a fused fp32 GEMV may round differently). on_token(id) is
    called for every new token as it is made (this reads each token back to the host: a sync per
    token). stop_tokens: stop after the first of these (also a sync per token). profile: record the
    kernels of one (untimed) graphed step in timings.step_kernels. Returns (tokens [n] int64 on the
    CPU, timings), n <= new_tokens. A CUDA graph capture that fails falls back to eager steps
    (timings.mode says which ran).
    fast_attention: while decoding, a model on SDPA attends for the one new token through
    `decode_attention` (two Triton kernels a layer instead of SDPA's five; default: on CUDA; True
    elsewhere only under Triton's interpreter, for tests); its prefill still goes through SDPA. On a
    CPU the default (None) attends through `cpu_attention` (one numba call a layer) unless the step is
    compiled (the compiler cannot trace it); False keeps SDPA everywhere. timings.attention says which
    ran.
    dependent_launch: launch the step's kernels (aqflow's GEMVs and attention, torch.compile's Triton
    kernels) with programmatic dependent launch, so each may start while the one before finishes
    (`aqflow.inference.dependent_launch`; default: on CUDA devices of compute capability >= 9.0, where
    alone it exists).
    cpu_layers: on a CPU with the numba attention (the default above), also run each Llama-style
    layer's RMSNorm, and its rotary embedding + cache update + attention, as one numba call each
    (`aqflow.inference.cpu_layers`: ~20 small torch operations a layer fewer); False leaves those modules'
    own forwards. timings.cpu_layers counts the modules switched.
    cuda_layers: with the one-token attention kernels (fast_attention), each Llama-style attention module
    rotates its query and key and writes the static cache inside those kernels
    (`aqflow.inference.cuda_layers`: four small kernels a layer fewer; default: on); False leaves the
    modules' own forwards around the attention call. timings.cuda_layers counts the modules switched.
    open_sums: the CUDA 2-bit linears that run the split-K kernel compute a step's token with open sums
    (`aqflow.inference.open_sums`: scales, bias and cast in the compiled step, the sums zeroed after each
    step; default: where the step is compiled on CUDA). timings.open_sums counts them.
    """
    device = model_device(model)
    pdl_here = dependent_launch_supported(device)
    if dependent_launch and not pdl_here:
        raise ValueError(f"dependent_launch=True needs a CUDA device of compute capability >= 9.0, the model is "
                         f"on {device}")
    if open_sums and device.type != "cuda":
        raise ValueError(f"open_sums=True: open sums are the CUDA kernels', the model is on {device}")
    dependent_launch = pdl_here if dependent_launch is None else dependent_launch
    graphs = device.type == "cuda" if graphs is None else graphs
    compile = graphs if compile is None else compile
    open_sums = compile and device.type == "cuda" if open_sums is None else open_sums
    if fuse is None or fuse:
        fuse_projections(model)  # idempotent: fused members are no longer nn.Linear or quantized linears
    fast_here = _attention_kernels_chosen(device, fast_attention)
    with one_token_paths(model, fast_attention, compile, cpu_layers, cuda_layers) as (implementation, switched), \
            dependent_launch_enabled(dependent_launch), open_sums_enabled(model, open_sums) as sums:
        tokens, timings = _greedy_decode(model, input_ids, new_tokens, graphs=graphs, on_token=on_token,
                                         compile=compile, stop_tokens=stop_tokens, warmup_steps=warmup_steps,
                                         profile=profile, sums=sums)
    return tokens, replace(timings, attention=implementation or "model's own", dependent_launch=dependent_launch,
                           cpu_layers=0 if fast_here else switched, cuda_layers=switched if fast_here else 0,
                           open_sums=len(sums.buffers) if sums is not None else 0)


def _attention_kernels_chosen(device: torch.device, fast_attention: bool | None) -> bool:
    """Whether decoding attends through the one-token Triton kernels (decode_attention, with cuda_layers)."""
    return device.type == "cuda" if fast_attention is None else fast_attention


@contextlib.contextmanager
def one_token_paths(model: torch.nn.Module, fast_attention: bool | None = None, compile: bool | None = None,
                    cpu_layers: bool | None = None,
                    cuda_layers: bool | None = None) -> Iterator[tuple[str | None, int]]:
    """The one-token attention (and its layers: cuda_layers with the attention kernels, cpu_layers on a CPU)
    that decoding `model` runs inside, as greedy_decode's fast_attention, compile, cpu_layers and
    cuda_layers choose them; yields (the attention implementation switched to, or None; how many modules
    cpu_layers or cuda_layers switched). Restored after."""
    device = model_device(model)
    kernels_run_here = device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"
    if fast_attention and not kernels_run_here:
        raise ValueError(f"fast_attention=True: the one-token attention kernels run on CUDA (or under "
                         f"TRITON_INTERPRET=1), the model is on {device}")
    switch, layers = contextlib.nullcontext(None), contextlib.nullcontext(0)
    if _attention_kernels_chosen(device, fast_attention):
        from aqflow.inference.decode_attention import decode_attention_enabled  # Triton: imported where used

        switch = decode_attention_enabled(model)
        if cuda_layers is None or cuda_layers:
            from aqflow.inference.cuda_layers import cuda_layers_enabled

            layers = cuda_layers_enabled(model)
    elif cuda_layers:
        raise ValueError("cuda_layers=True: the attention layers with the rotary embedding inside run with the "
                         f"one-token attention kernels (the model is on {device}, fast_attention={fast_attention})")
    elif device.type == "cpu" and fast_attention is None and not compile:  # torch.compile cannot trace numba
        from aqflow.inference.cpu_attention import cpu_attention_enabled

        switch = cpu_attention_enabled(model)
        if cpu_layers is None or cpu_layers:
            from aqflow.inference.cpu_layers import cpu_layers_enabled

            layers = cpu_layers_enabled(model)
    elif cpu_layers:
        raise ValueError("cpu_layers=True: the one-token CPU layers run in an eager CPU decode with the numba "
                         f"attention (the model is on {device}, compile={compile}, fast_attention={fast_attention})")
    with switch as implementation, layers as switched:
        yield implementation, switched


def _greedy_decode(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, *, graphs: bool,
                   on_token: Callable[[int], None] | None, compile: bool,
                   stop_tokens: Collection[int] | None, warmup_steps: int,
                   profile: bool, sums: StepSums | None) -> tuple[torch.Tensor, DecodeTimings]:
    """greedy_decode with the model's attention, fusion and open sums as they are set."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids {tuple(input_ids.shape)}: expected [1, prompt_tokens] (batch 1)")
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}: at least one token")
    device = model_device(model)
    if graphs and device.type != "cuda":
        raise ValueError(f"graphs=True needs a CUDA model, this one is on {device}")
    model.eval()
    prompt_tokens = input_ids.shape[1]
    stop = frozenset(stop_tokens or ())
    per_token_sync = on_token is not None or bool(stop)
    cache = new_static_cache(model, prompt_tokens + new_tokens)
    input_ids = input_ids.to(device)

    _synchronize(device)
    start = time.perf_counter()
    out = model(input_ids=input_ids, position_ids=torch.arange(prompt_tokens, device=device)[None],
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    first = greedy_token(out.logits[:, -1, :])  # [1]
    _synchronize(device)
    prefill_seconds = time.perf_counter() - start
    del out

    generated = torch.zeros(new_tokens, dtype=torch.long, device=device)
    generated[0] = first[0]
    token = first.view(1, 1).clone()
    position = torch.full((1, 1), prompt_tokens, dtype=torch.long, device=device)
    def next_token(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # Branching on the launch setting makes torch.compile guard on it. A step compiled with programmatic
        # dependent launch (which decides how inductor writes and launches its kernels) is then not reused
        # without it, or the other way round; a new closure of the same code would be. Both branches compute
        # the same. The token is chosen inside the step, so that a compiled step compiles that too.
        if dependent_launch_active():
            return greedy_token(step_logits(model, cache, token, position))
        return greedy_token(step_logits(model, cache, token, position))

    plain_next_token = next_token
    if compile:
        next_token = torch.compile(next_token, dynamic=False)
    # generated[0] is the prefill's token; the step at position P-1+k writes generated[k]
    step = _DecodeStep(next_token, token, position, generated, first_position=prompt_tokens - 1, sums=sums)
    compile_error: str | None = None

    def run_step() -> None:
        """One step; a compiled forward that fails (at its first call: compiling happens there, before any
        state is written) is replaced by the plain one and the step run again."""
        nonlocal compile_error
        try:
            step()
        except Exception as error:  # noqa: BLE001 - torch.compile's failures are of many types
            if step.next_token is plain_next_token:
                raise
            compile_error = f"{type(error).__name__}: {str(error)[:500]}"
            print(f"greedy_decode: torch.compile failed ({compile_error}); decoding without it")
            step.next_token = plain_next_token
            step()

    done = 0
    stopped = False

    def emit(upto: int) -> bool:
        """Report tokens done..upto-1 to on_token; True once a stop token came."""
        nonlocal done
        if not per_token_sync:
            done = upto
            return False
        values = generated[done:upto].tolist()
        for value in values:
            done += 1
            if on_token is not None:
                on_token(value)
            if value in stop:
                return True
        return False

    stopped = emit(1)
    capture_seconds = 0.0
    graph = None
    steps_left = new_tokens - 1
    if graphs and not stopped and steps_left > warmup_steps:
        capture_start = time.perf_counter()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):  # real steps: kernels compiled/tuned, the cache filled in order
                run_step()
        torch.cuda.current_stream(device).wait_stream(side)
        steps_left -= warmup_steps
        stopped = emit(1 + warmup_steps)
        if not stopped:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()  # recorded, not run: buffers and cache keep the warm-up's state
            except Exception as error:  # noqa: BLE001 - any capture failure means: decode eagerly
                graph = None
                print(f"greedy_decode: CUDA graph capture failed ({type(error).__name__}: {error}); decoding eagerly")
        _synchronize(device)
        capture_seconds = time.perf_counter() - capture_start

    step_kernels: list[tuple[str, float]] = []
    if profile and not stopped and steps_left > 1:
        try:
            step_kernels = profile_kernels(graph.replay if graph is not None else run_step, device)
        except Exception as error:  # noqa: BLE001 - a profiler failure must not cost the measurement
            print(f"greedy_decode: profiling one step failed ({type(error).__name__}: {error})")
            _synchronize(device)
        steps_left -= 1  # the step ran (or was attempted) either way
        stopped = emit(new_tokens - steps_left)

    _synchronize(device)
    start = time.perf_counter()
    timed = 0
    while steps_left > 0 and not stopped:
        if graph is not None:
            graph.replay()
        else:
            run_step()
        steps_left -= 1
        timed += 1
        if per_token_sync:
            stopped = emit(done + 1)
    _synchronize(device)
    decode_seconds = time.perf_counter() - start
    if not per_token_sync:
        done = new_tokens - steps_left
    tokens = generated[:done].cpu()
    compiled = compile and step.next_token is not plain_next_token
    mode = ("compile+" if compiled else "") + ("graph" if graph is not None else "eager")
    timings = DecodeTimings(prompt_tokens=prompt_tokens, prefill_seconds=prefill_seconds, new_tokens=done,
                            decode_seconds=decode_seconds, timed_steps=timed, capture_seconds=capture_seconds,
                            mode=mode, step_kernels=tuple(step_kernels), compile_error=compile_error)
    return tokens, timings


# ---------------------------------------------------------------- fused projections

class _SharedProjection:
    """The one product of several projections of the same input, made by whichever member is called
    first and handed out slice by slice (a forward calls q, k, v or gate, up one after another)."""

    def __init__(self, compute: Callable[[torch.Tensor], torch.Tensor], sizes: Sequence[int]):
        self.compute = compute
        self.sizes = list(sizes)
        self.input: torch.Tensor | None = None
        self.parts: list[torch.Tensor | None] = []

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.input is not x or self.parts[index] is None:
            fused = self.compute(x)
            self.input = x
            self.parts = list(torch.split(fused, self.sizes, dim=-1))
        result = self.parts[index]
        self.parts[index] = None
        if all(p is None for p in self.parts):  # every member served: hold nothing between forwards
            self.input = None
        return result


class FusedProjectionMember(torch.nn.Module):
    """Stands where one of the fused projections stood; its output is its slice of the shared product."""

    def __init__(self, shared: _SharedProjection, index: int, in_features: int, out_features: int,
                 owner: torch.nn.Module):
        super().__init__()
        self._shared = shared
        self.index = index
        self.in_features, self.out_features = in_features, out_features
        # the shared weights are registered once, in the first member
        if owner is not None:
            self.fused = owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.part(x, self.index)

    def shared_product(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], int, int]:
        """(the fused product's module, this member's index in it, how many members it has): for a caller that
        wants the whole product at once (cuda_layers: q, k and v as one tensor)."""
        return self._shared.compute, self.index, len(self._shared.sizes)


class FusedDenseLinear(torch.nn.Module):
    """Several nn.Linear (or CpuBf16Linear) of one input as one [sum(out), in] weight."""

    def __init__(self, linears: Sequence[torch.nn.Module]):
        super().__init__()
        self.in_features = linears[0].in_features
        self.out_features = sum(l.out_features for l in linears)
        self.weight = torch.nn.Parameter(torch.cat([l.weight.data for l in linears], dim=0), requires_grad=False)
        if any(l.bias is not None for l in linears):
            self.bias = torch.nn.Parameter(torch.cat([
                l.bias.data if l.bias is not None else torch.zeros(l.out_features, dtype=l.weight.dtype, device=l.weight.device)
                for l in linears]), requires_grad=False)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def quantized_weights_of(module: torch.nn.Module) -> QuantizedWeights | None:
    """The QuantizedWeights a quantized linear module serves (through its `quantized_weights()`), else None."""
    getter = getattr(module, "quantized_weights", None)
    return getter() if callable(getter) else None


class FusedQuantizedLinear(torch.nn.Module):
    """One or several quantized linears of one input in one kernel launch (their codes concatenated by rows),
    held as the kernels read them fastest: the codes in tiles where their shape allows (`packed.in_tiles`)."""

    open_sums = None  # an open_sums.OpenSumsSite inside open_sums_enabled: one token computed with open sums

    def __init__(self, weights: Sequence[QuantizedWeights]):
        super().__init__()
        from aqflow.inference.packed import in_tiles, pack_weights

        self.packed = in_tiles(pack_weights(weights))
        for name, tensor in self.packed.tensors().items():
            self.register_buffer(name, tensor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from aqflow.inference import gpu_kernels

        if self.open_sums is not None:
            return self.open_sums(x)
        return gpu_kernels.packed_matmul(x, self.packed)


_LLAMA_FAMILY_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _held_for_cpu_kernels(module: torch.nn.Module) -> bool:
    """A FastQuantizedLinear on a CPU: its codes in the CPU kernels' own layouts (never Triton's interpreter)."""
    from aqflow.inference.fast_linear import FastQuantizedLinear

    return type(module) is FastQuantizedLinear and module.codes.device.type == "cpu"


def _gpu_kernels_take(weights: QuantizedWeights) -> bool:
    """The GPU kernels run these weights: on CUDA, or in Triton's interpreter (tests)."""
    from aqflow.inference import gpu_kernels

    return weights.codes.is_cuda or gpu_kernels._interpreting()


def _kernel_operand(module: torch.nn.Module) -> torch.nn.Module | None:
    """A quantized linear the GPU kernels run as a FusedQuantizedLinear of its own, whose codes lie in the
    kernels' tiles; None where its codes cannot be tiled or it is no such linear."""
    from aqflow.inference.packed import as_packed, can_tile

    if isinstance(module, (FusedQuantizedLinear, FusedProjectionMember)) or _held_for_cpu_kernels(module):
        return None
    weights = quantized_weights_of(module)
    if weights is None or not _gpu_kernels_take(weights) or not can_tile(as_packed(weights)):
        return None
    return FusedQuantizedLinear([weights])


def fuse_projections(model: torch.nn.Module) -> list[str]:
    """Replaces, in every decoder layer of a Llama-family model (Llama, Mistral, Qwen2), q/k/v and
    gate/up by members of one fused product: one GEMV for nn.Linear (cuBLAS, or BLAS on a CPU) and for
    CpuBf16Linear (numba's bf16 GEMV), one quantized kernel launch for quantized linears on CUDA
    (modules with `quantized_weights()`), one register-kernel call for FastQuantizedLinear held as
    column tiles on a CPU (FusedColumnsLinear). Groups mixing kinds, and other quantized layers on a
    CPU, stay unfused. On CUDA the decoder layers' other quantized linears (o_proj, down_proj) become a
    FusedQuantizedLinear of their own too, so that every 2-bit product reads its codes in tiles. Returns
    the names of the fused groups."""
    fused: list[str] = []
    for layer_name, layer in _decoder_layers(model):
        for block_name, names in _LLAMA_FAMILY_GROUPS:
            block = getattr(layer, block_name, None)
            members = [getattr(block, n, None) for n in names] if block is not None else []
            if len(members) != len(names) or any(m is None for m in members):
                continue
            owner = _fused_owner(members)
            if owner is None:
                continue
            sizes = [m.out_features for m in members]
            shared = _SharedProjection(owner, sizes)
            for index, (name, member) in enumerate(zip(names, members)):
                setattr(block, name, FusedProjectionMember(shared, index, member.in_features, member.out_features,
                                                           owner if index == 0 else None))
            fused.append(f"{layer_name}.{block_name}.{'+'.join(names)}")
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if (operand := _kernel_operand(child)) is not None:
                    setattr(parent, name, operand)
    return fused


def _decoder_layers(model: torch.nn.Module):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        return []
    prefix = "model.layers" if base is not model else "layers"
    return [(f"{prefix}.{i}", layer) for i, layer in enumerate(layers)]


def _fused_owner(members: Sequence[torch.nn.Module]) -> torch.nn.Module | None:
    from aqflow.inference.fast_linear import CpuBf16Linear, FusedColumnsLinear, fused_columns_fit

    if all(type(m) is torch.nn.Linear for m in members) or all(type(m) is CpuBf16Linear for m in members):
        if len({m.in_features for m in members}) != 1:
            return None
        fused = FusedDenseLinear(members)
        return fused if type(members[0]) is torch.nn.Linear else CpuBf16Linear(fused)
    if fused_columns_fit(members):  # 2-bit layers on a CPU: one register-kernel call for all
        return FusedColumnsLinear(list(members))
    if any(_held_for_cpu_kernels(m) for m in members):
        return None  # other CPU layouts: the numba kernels, one call a layer
    weights = [quantized_weights_of(m) for m in members]
    if all(w is not None for w in weights):
        from aqflow.inference.packed import can_pack

        if _gpu_kernels_take(weights[0]) and can_pack(weights):
            return FusedQuantizedLinear(weights)
    return None
