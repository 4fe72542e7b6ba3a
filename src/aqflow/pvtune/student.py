"""The student: an AQLM checkpoint as a trainable nn.Module, and writing it back as a checkpoint.

Every quantized linear of the checkpoint becomes a `PVLinear` whose weight [out, in] is
dequantized on the fly from integer codes (a buffer, never touched by autograd) and trainable
float32 codebooks and scales:

    W[o, j*g:(j+1)*g] = scales[o] * sum_m codebooks[m, codes[o, j, m], :]

so the gradient of the loss reaches codebooks and scales (the P-step). With the V-step on, the
layer also holds `straight_through` [out, in], a float copy of its weight. The forward adds
`st - st.detach()`, which is zero in value, so the output is exactly the quantized layer's while
dL/dst = dL/dW: the straight-through estimator. Making it a Parameter lets gradient
accumulation, gradient checkpointing and the cross-process gradient average treat it like any
other weight.

Training uses a cheaper path with the same gradients (`open_weight_gradients`): the forward
dequantizes the weight without an autograd graph, straight into the compute dtype, and the
backward adds dL/dW of every micro-batch into one float32 buffer per layer (the straight-through
weight's .grad when there is one). `close_weight_gradients` then pushes that sum through the
dequantization once per optimiser step, into codebooks and scales. Per micro-batch the old path
ran the gather's backward (a sort of every code) and several float32 passes over each weight;
this one runs one matmul for dL/dW.

Over several processes (`aqflow.pvtune.distributed`) a layer's straight-through weight and the
dL/dW buffer hold only this process's rows (`PVLinear.rows`): each micro-batch's dL/dW, of this
process's windows, is reduce-scattered onto the processes' rows, and `close_weight_gradients`
pushes each process's rows through the dequantization and sums the codebooks' and scales'
gradients over the processes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from aqflow.io.artifacts import atomic_dir, write_json
from ..models import folder as model_folder
from .distributed import RowReducer, all_reduce_flat, rows_per_process, world
from .loss import add_matmul_float32, compute_dtype_of
from ..models.fetch import torch_dtype
from ..quant.representation import dequantize_weight, pack_codes, unpack_codes


class StudentError(ValueError):
    """The checkpoint cannot be turned into a student (unsupported layout, tensors that do not fit
    the model); the message says why. A folder that is no AQLM checkpoint raises NotAqlmError and
    one with incomplete quantized linears ModelFolderError (aqflow.models.folder)."""


def code_dtype(num_codewords: int) -> torch.dtype:
    """The smallest signed integer dtype that holds codes in [0, num_codewords): int16 up to 2^15, else int32."""
    return torch.int16 if num_codewords <= 1 << 15 else torch.int32


class PVLinear(nn.Module):
    """A quantized linear with trainable codebooks and scales and integer codes.

    codes [out, G, M] int16 in [0, K) for K <= 2^15, else int32 (a buffer whole on every process:
    at 8-bit codes int16 takes half of int32's 6.5 GiB at Llama-3.1-8B; the dequantization's index
    arithmetic promotes it), codebooks [M, K, g] float32, scales [out] float32, bias [out] or None;
    straight_through [stop - start, in] float32 or None, this process's `rows` [start, stop) of
    the weight (all of them in a single process; see `enable_straight_through`).
    """

    def __init__(self, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        num_rows, num_groups, num_codebooks = codes.shape
        if codebooks.dim() != 3 or codebooks.shape[0] != num_codebooks or scales.shape != (num_rows,):
            raise StudentError(f"codes {tuple(codes.shape)}, codebooks {tuple(codebooks.shape)} and scales "
                               f"{tuple(scales.shape)} do not form one AQLM layer")
        self.out_features, self.in_features = num_rows, num_groups * codebooks.shape[-1]
        self.register_buffer("codes", codes.to(code_dtype(codebooks.shape[1])))
        self.codebooks = nn.Parameter(codebooks.float())
        self.scales = nn.Parameter(scales.float())
        self.bias = None if bias is None else nn.Parameter(bias.float())
        self.straight_through: nn.Parameter | None = None
        self.rows = (0, num_rows)  # the rows of the V-step's state this process holds
        self.weight_gradient: torch.Tensor | None = None  # float32 [rows, in] while open_weight_gradients is on
        self.reducer: RowReducer | None = None  # sums dL/dW over processes onto `rows` (set while open)
        # dL/dW's buffer on the card where the straight-through weight is in host memory (offload)
        self.device_gradient: torch.Tensor | None = None
        self.keep_weight = False  # keep the compute-dtype weight between optimiser steps (`compute_weight`)
        self.weight_cache: torch.Tensor | None = None

    @property
    def nbits(self) -> int:
        return self.codebooks.shape[1].bit_length() - 1

    @property
    def group_size(self) -> int:
        return self.codebooks.shape[-1]

    def dequantized(self) -> torch.Tensor:
        """The weight the codes represent, [out, in] float32; differentiable in codebooks and scales."""
        return dequantize_weight(self.codes, self.codebooks, self.scales)

    def dequantized_rows(self) -> torch.Tensor:
        """Rows `self.rows` of the weight, [stop - start, in] float32; differentiable in codebooks and scales."""
        start, stop = self.rows
        return dequantize_weight(self.codes[start:stop], self.codebooks, self.scales[start:stop])

    @torch.no_grad()
    def weight_rms(self) -> float:
        """Root mean square of the whole weight the codes represent (every process computes it alike)."""
        return float(self.dequantized().square().mean().sqrt())

    def enable_straight_through(self, rows: tuple[int, int] | None = None) -> None:
        """Create the float copy of the weight that the V-step optimises: of `rows` [start, stop)
        (default: every row), [stop - start, in] float32."""
        self.rows = (0, self.out_features) if rows is None else rows
        with torch.no_grad():
            self.straight_through = nn.Parameter(self.dequantized_rows().detach().clone())

    @torch.no_grad()
    def compute_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in] in `dtype`, outside autograd: made once and kept while
        `keep_weight` is on (codes, codebooks and scales change only between optimiser steps, and
        a step's micro-batches and held-out passes would dequantize it two or three times each)."""
        cached = self.weight_cache
        if cached is not None and cached.dtype == dtype:
            return cached
        weight = self.dequantized().to(dtype)
        if self.keep_weight:
            self.weight_cache = weight
        return weight

    def forget_weight(self) -> None:
        """Drop the kept weight (after an optimiser step changed what it is made of)."""
        self.weight_cache = None

    @torch.compiler.disable  # side effects (kept weight, dL/dW buffer) no graph can hold: `compiled`
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: in x's dtype, or autocast's on the accumulate-dL/dW path."""
        if self.weight_gradient is not None or not torch.is_grad_enabled():
            # training's accumulate-dL/dW path, or no autograd at all (held-out evaluation): the
            # compute-dtype weight, kept where keep_weight is on (the next step reuses it)
            compute_dtype = compute_dtype_of(x)
            x = x.to(compute_dtype)
            output = (_WeightGradientLinear.apply(x, self) if self.weight_gradient is not None
                      else F.linear(x, self.compute_weight(compute_dtype)))
            return output if self.bias is None else output + self.bias.to(output.dtype)
        weight = self.dequantized()
        if self.straight_through is not None and self.straight_through.requires_grad:
            # zero in value: dL/dst = dL/dW of its rows
            start, stop = self.rows
            moved = self.straight_through - self.straight_through.detach()
            weight = torch.cat([weight[:start], weight[start:stop] + moved, weight[stop:]])
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight.to(x.dtype), bias)


def _add_weight_gradient(layer: "PVLinear", grad_output: torch.Tensor, x: torch.Tensor) -> None:
    """The layer's rows of grad_output [N, out]ᵀ @ x [N, in], summed in float32 over processes,
    added into its `weight_gradient` [rows, in] float32 (in place, or through its `reducer`)."""
    if world()[1] == 1:
        add_matmul_float32(layer.weight_gradient, grad_output.t(), x)
        return
    padded = rows_per_process(layer.out_features, world()[1]) * world()[1]
    full = torch.zeros(padded, layer.in_features, dtype=layer.weight_gradient.dtype, device=x.device)
    add_matmul_float32(full[:layer.out_features], grad_output.t(), x)
    layer.reducer.add(full, layer.weight_gradient)


class _WeightGradientLinear(torch.autograd.Function):
    """x @ Wᵀ for a `PVLinear` whose W autograd does not track: the backward returns dL/dx and
    adds dL/dW into the layer's `weight_gradient` buffer (see `open_weight_gradients`).

    x [..., in] in the compute dtype -> [..., out] in that dtype; the backward takes
    grad_output [..., out] and returns dL/dx [..., in] (None for the layer).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "PVLinear") -> torch.Tensor:
        ctx.layer = layer
        # the weight is dequantized again in the backward pass rather than kept: without activation
        # checkpointing every layer's weight would otherwise stay alive until its backward
        ctx.save_for_backward(x)
        return F.linear(x, layer.compute_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        if layer.weight_gradient is None:
            raise RuntimeError("a PVLinear's backward ran after close_weight_gradients: its dL/dW would be lost")
        grad_x = grad_output @ layer.compute_weight(grad_output.dtype) if ctx.needs_input_grad[0] else None
        _add_weight_gradient(layer, grad_output.reshape(-1, grad_output.shape[-1]), x.reshape(-1, x.shape[-1]))
        return grad_x, None


def open_weight_gradients(layers, reducer: RowReducer | None = None) -> None:
    """Switch `layers` (PVLinear) to the accumulate-dL/dW path until `close_weight_gradients`.

    The buffer [rows, in] float32 is the straight-through weight's .grad (created as zeros if
    absent), else a new zero tensor of the layer's `rows`; a no-op for a layer whose weight
    gradient nothing needs. `reducer`: the processes' reductions (one is made if none is given).
    """
    reducer = reducer or RowReducer()
    for layer in layers:
        if layer.weight_gradient is not None:
            continue
        straight_through = layer.straight_through
        if layer.device_gradient is not None:  # the V-step's state is in host memory (offload)
            layer.weight_gradient = layer.device_gradient
        elif straight_through is not None and straight_through.requires_grad:
            if straight_through.grad is None:
                straight_through.grad = torch.zeros_like(straight_through)
            layer.weight_gradient = straight_through.grad
        elif layer.codebooks.requires_grad or layer.scales.requires_grad:
            start, stop = layer.rows
            layer.weight_gradient = torch.zeros(stop - start, layer.in_features, dtype=layer.codebooks.dtype,
                                                device=layer.codes.device)
        else:
            continue
        layer.reducer = reducer


def close_weight_gradients(layers) -> None:
    """Back-propagate each layer's accumulated dL/dW (its rows, once every pending reduction is
    done) through its dequantization into the .grad of codebooks and scales, sum those over
    processes, and switch the layers back to the plain path."""
    for reducer in {id(layer.reducer): layer.reducer for layer in layers if layer.reducer is not None}.values():
        reducer.finish()
    reached = []
    for layer in layers:
        accumulated = layer.weight_gradient
        if accumulated is None:
            continue
        layer.weight_gradient, layer.reducer = None, None
        if layer.codebooks.requires_grad or layer.scales.requires_grad:
            with torch.enable_grad():
                layer.dequantized_rows().backward(accumulated)
        for parameter in (layer.codebooks, layer.scales):
            if parameter.requires_grad:  # a process without rows of the layer adds zeros
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                reached.append(parameter.grad)
    if world()[1] > 1:  # each process summed its rows: one flat sum over processes
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for gradient in reached:
            by_dtype.setdefault(gradient.dtype, []).append(gradient)
        for gradients in by_dtype.values():
            all_reduce_flat(gradients)


# --- reading -------------------------------------------------------------------------------------

def aqlm_settings(checkpoint_dir: str | os.PathLike) -> dict:
    """quantization_config of an AQLM checkpoint with one output row per group (the only kind a
    student is built from); NotAqlmError / StudentError for anything else."""
    config = model_folder.aqlm_quantization_config(checkpoint_dir)
    if config.get("out_group_size", 1) != 1:
        raise StudentError(f"{checkpoint_dir}: out_group_size {config['out_group_size']} is not supported (only 1)")
    return config


def _plain_config(checkpoint_dir: Path):
    """The model config without quantization_config, so transformers builds plain nn.Linear layers."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


def load_student(checkpoint_dir: str | os.PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """The AQLM checkpoint as a float32 causal LM whose quantized linears are `PVLinear`
    (codes [out, G, M] int16/int32 unpacked from the stored int8/int16, codebooks [M, K, g] from the
    stored [M, K, 1, g], scales [out] from [out, 1, 1, 1], all on `device`).

    Every tensor of the checkpoint is used: quantized linears from their codes, codebooks and
    scales (and bias), everything else loaded into the model built from the checkpoint's config.
    Raises StudentError if a tensor is left over or a model tensor is not in the checkpoint
    (tied output embeddings excepted).
    """
    from transformers import AutoModelForCausalLM

    checkpoint_dir = Path(checkpoint_dir)
    nbits = int(aqlm_settings(checkpoint_dir)["nbits_per_codebook"])
    tensors = model_folder.read_tensors(checkpoint_dir)
    prefixes = model_folder.quantized_linear_prefixes(tensors, checkpoint_dir)
    if not prefixes:
        raise StudentError(f"{checkpoint_dir} holds no quantized linears ('*.codes' tensors)")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_plain_config(checkpoint_dir), dtype=torch.float32)
    used: set[str] = set()
    for prefix in prefixes:
        try:
            original = model.get_submodule(prefix)
        except AttributeError:
            raise StudentError(f"{checkpoint_dir}: quantized tensor {prefix}.codes names no module of the model") from None
        if not isinstance(original, nn.Linear):
            raise StudentError(f"{checkpoint_dir}: {prefix} is a {type(original).__name__}, not a linear")
        bias = tensors.get(f"{prefix}.bias")
        if (bias is None) != (original.bias is None):
            raise StudentError(f"{checkpoint_dir}: {prefix} bias present in the checkpoint: {bias is not None}, "
                               f"in the model: {original.bias is not None}")
        layer = PVLinear(unpack_codes(tensors[f"{prefix}.codes"], nbits), tensors[f"{prefix}.codebooks"][:, :, 0, :],
                         tensors[f"{prefix}.scales"].reshape(-1), bias).to(device)
        if (layer.out_features, layer.in_features) != (original.out_features, original.in_features):
            raise StudentError(f"{checkpoint_dir}: {prefix} is [{original.out_features}, {original.in_features}] in the "
                               f"model but its codes describe [{layer.out_features}, {layer.in_features}]")
        parent_name, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        used.update(f"{prefix}.{key}" for key in (*model_folder.AQLM_TENSORS, "bias"))
    rest = {name: tensor.float() if tensor.is_floating_point() else tensor
            for name, tensor in tensors.items() if name not in used}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    embedding = model.get_input_embeddings().weight
    tied = {name for name, parameter in model.named_parameters(remove_duplicate=False) if parameter is embedding}
    missing = [name for name in missing if name not in tied and name not in used]
    if missing or unexpected:
        raise StudentError(f"{checkpoint_dir} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device)


def pv_linears(model: nn.Module) -> dict[str, PVLinear]:
    """The student's quantized linears by module name, in module order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, PVLinear)}


# --- writing -------------------------------------------------------------------------------------

def student_tensors(model: nn.Module, like: dict[str, str], state: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The student as checkpoint tensors with exactly the names and dtypes of `like` ({name: dtype}):
    X.codes packed as AQLM stores them, X.codebooks [M, K, 1, g], X.scales [out, 1, 1, 1], every other
    tensor from the state dict (`state`, where given: the whole one of a sharded student).
    Straight-through copies are not part of a checkpoint."""
    layers = pv_linears(model)
    state = model.state_dict() if state is None else state
    out: dict[str, torch.Tensor] = {}
    for name, stored in like.items():
        prefix, _, key = name.rpartition(".")
        if prefix in layers and key in model_folder.AQLM_TENSORS:
            layer = layers[prefix]
            tensor = {"codes": lambda: pack_codes(layer.codes, layer.nbits),
                      "codebooks": lambda: layer.codebooks.detach()[:, :, None, :],
                      "scales": lambda: layer.scales.detach().reshape(-1, 1, 1, 1)}[key]()
        elif name in state:
            tensor = state[name].detach()
        else:
            raise StudentError(f"the student has no tensor {name!r} that the source checkpoint holds")
        if stored in model_folder.FLOAT_DTYPE_NAMES:
            tensor = tensor.to(getattr(torch, model_folder.FLOAT_DTYPE_NAMES[stored]))
        out[name] = tensor.cpu().contiguous()
    return out


def save_student(model: nn.Module, source_dir: str | os.PathLike, output_dir: str | os.PathLike, record: dict,
                 state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the student as an AQLM checkpoint like `source_dir` (same config, tensor names and
    dtypes, tokenizer files), atomically, with `record` added to the aqflow marker as "pvtune";
    `state`: its whole state dict where its modules hold only shards (`student_tensors`)."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    stored_dtypes = {name: header.dtype for name, header in model_folder.tensor_headers(source_dir).items()}
    tensors = student_tensors(model, stored_dtypes, state)
    marker = model_folder.read_marker(source_dir) or {}
    with atomic_dir(output_dir) as staging:
        model_folder.write_weights(staging, tensors)
        shutil.copy2(source_dir / model_folder.CONFIG_FILE, staging / model_folder.CONFIG_FILE)
        model_folder.copy_side_files(source_dir, staging)
        write_json(staging / model_folder.MARKER_FILE, {**marker, "pvtune": record,
                                                       "pvtune_source_checkpoint": str(source_dir)})
    return output_dir


def load_teacher(model_dir: str | os.PathLike, device: str | torch.device, dtype: str) -> nn.Module:
    """The full-precision model, frozen, in eval mode, its weights in `dtype` on `device`."""
    from ..models.fetch import load_causal_lm

    torch_dtype(dtype)  # refuse a bad name before loading anything
    teacher = load_causal_lm(model_dir, dtype=dtype, device=device)
    teacher.requires_grad_(False)
    return teacher
