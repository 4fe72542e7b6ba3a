"""The processes of one PV-tuning run (torchrun; NCCL on GPUs, gloo on CPUs) and what each holds.

Every process takes its share of each batch's windows. What the state is made of is held once
over the processes, not once per process:

* the teacher and the student's non-quantized parameters (embeddings, head, norms, biases), with
  their gradients and Adam moments, are sharded by PyTorch's FSDP2 (`fully_shard`): every decoder
  block is one unit, the rest of each model (embeddings, final norm, head) another, the root;
* every quantized layer's V-step state (its straight-through weight, that weight's gradient and
  Adam moments: 12-16 bytes per weight, most of the whole) is split by output rows: process r
  holds rows `row_range(out, r, N)`. It never enters a forward pass (the forward reads the
  codes), so FSDP, which gathers a unit's parameters for every forward, does not manage it: each
  micro-batch's dL/dW of a layer is reduce-scattered onto those rows instead (`RowReducer`);
* codes, codebooks and scales are whole on every process (codes are integers the V-step rewrites
  everywhere alike; codebooks and scales are 0.03 % of the state): the gradients of codebooks and
  scales, each process's sum over its rows, are summed over processes in one flat all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


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


def rows_per_process(num_rows: int, size: int) -> int:
    """Rows of each process's share of a layer: ceil(num_rows / size) (FSDP's split of dim 0)."""
    return math.ceil(num_rows / size)


def row_range(num_rows: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the rows process `rank` of `size` holds; the last processes may hold fewer, or none."""
    share = rows_per_process(num_rows, size)
    start = min(rank * share, num_rows)
    return start, min(start + share, num_rows)


def all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    """Sum `tensors` (any shapes, one dtype and device) over processes in place, as one flat buffer."""
    if world()[1] == 1 or not tensors:
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


class RowReducer:
    """Sums a full [out, in] dL/dW over processes onto each process's rows, asynchronously.

    `add(full, rows)`: full [padded_out, in] float32 (this process's micro-batch; rows past `out`
    zero), rows [share, in] float32 (this process's accumulator, its rows of the layer) += the
    sum over processes of full's rows of this process. At most `in_flight` reductions are pending
    (each holds its full gradient until it completes); `finish` completes them all. A single
    process adds its full rows in place.
    """

    def __init__(self, in_flight: int = 2):
        self.in_flight = in_flight
        self.pending: list[tuple[object, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.group = None

    def add(self, full: torch.Tensor, rows: torch.Tensor) -> None:
        _, size = world()
        if size == 1:
            rows.add_(full[:rows.shape[0]])
            return
        if self.group is None:  # collectives of their own: never interleaved with FSDP's
            self.group = dist.new_group(backend=dist.get_backend())
        share = full.shape[0] // size
        received = torch.empty(share, full.shape[1], dtype=full.dtype, device=full.device)
        work = dist.reduce_scatter_tensor(received, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.pending.append((work, received, rows, full))
        while len(self.pending) > self.in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        work, received, rows, _ = self.pending.pop(0)
        work.wait()
        rows.add_(received[:rows.shape[0]])

    def finish(self) -> None:
        while self.pending:
            self._complete_oldest()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated decoder blocks (the classes its `_no_split_modules` names: transformers
    marks the unit that must stay whole on one device with it), in module order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder block class (_no_split_modules): it cannot be "
                         f"sharded over processes")
    return blocks


def shard_over_processes(root: nn.Module, model: nn.Module, ignored: Iterable[nn.Parameter], device: torch.device) -> None:
    """FSDP2 on `root` (a module whose forward runs `model`'s): each decoder block of `model` one
    unit, the rest of `root` the root unit; `ignored` parameters stay whole and unmanaged.
    Gradients are summed over processes, not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world()[1],))
    ignored = set(ignored)
    for unit in [*decoder_blocks(model), root]:
        fully_shard(unit, mesh=mesh, ignored_params=ignored)
        # each process's loss is already its share of the batch's mean: sum, FSDP's default averages
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def gathered_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded tensor (FSDP2's DTensors) gathered whole, on the
    host; the rest as the module holds it. A collective: every process calls it alike."""
    state = {}
    for name, tensor in module.state_dict().items():
        state[name] = tensor.full_tensor().cpu() if hasattr(tensor, "full_tensor") else tensor
    return state


def held_bytes(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer | None]) -> int:
    """Bytes of the training state this process holds: every parameter, gradient and buffer of
    `modules` and every optimiser state tensor (this process's parts; a storage shared by
    several tensors counted once). Activations and temporaries are not part of it."""
    tensors = []
    for module in modules:
        for parameter in module.parameters():
            tensors.append(local(parameter.detach()))
            if parameter.grad is not None:
                tensors.append(local(parameter.grad))
        tensors += [local(buffer) for buffer in module.buffers()]
    for optimizer in optimizers:
        if optimizer is not None:
            tensors += [local(value) for state in optimizer.state.values() for value in state.values()
                        if torch.is_tensor(value)]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), storage.device)] = storage.nbytes()
    return sum(storages.values())
