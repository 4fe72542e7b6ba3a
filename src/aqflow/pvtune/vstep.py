"""The V-step: move codes toward the straight-through weight, a bounded number of groups at a time.

After the optimiser has stepped the float copy W_st [out, in] of a layer, the codes are
re-encoded toward it in weight space: for a chosen group i (row o, input group j) the new codes
minimise

    || W_st[o, j] - s_o * sum_m C_m[codes_m] ||^2

which is the whole-row objective of `quant.beam_search` with XᵀX = I restricted to one group:
with the identity the groups of a row do not interact, so every group is searched on its own as
a one-group "row" (weight [n, g], XᵀX = I_g). The search starts from the current codes and keeps
them as a candidate, so a group's error to W_st never grows.

At most ceil(max_fraction * N) of the N groups are searched per step: those with the largest
||W_st - W_q||² first (the groups where the accumulated straight-through updates have moved
furthest from what the codes represent). Groups whose error is exactly zero are never chosen.

Over several processes each holds the straight-through rows of its share of every layer
(`aqflow.pvtune.distributed`): it proposes its rows' largest errors, every process picks the
same largest ceil(max_fraction * N) of the layer from all proposals, each re-encodes the chosen
groups of its rows, and every process writes every new code: the codes stay identical everywhere
and equal a single process's choice (`distributed_v_step`).
"""

from __future__ import annotations

import math

import torch

from ..quant.beam_search import beam_search_rows, rows_per_chunk
from .distributed import world

DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30


def group_squared_errors(target: torch.Tensor, current: torch.Tensor, group_size: int) -> torch.Tensor:
    """||target - current||² per group of `group_size` consecutive inputs.

    target [out, in], current [out, in] (same floating dtype) -> [out, in / group_size] in that dtype
    """
    num_rows, in_features = target.shape
    difference = (target - current).view(num_rows, in_features // group_size, group_size)
    return difference.square().sum(-1)


def groups_to_update(errors: torch.Tensor, max_fraction: float) -> torch.Tensor:
    """Flat indices (row * G + group) of the groups to re-encode, largest error first.

    errors [out, G] floating -> [n] int64 with n <= ceil(max_fraction * out * G), only groups with error > 0
    """
    if not 0.0 < max_fraction <= 1.0:
        raise ValueError(f"max_fraction must lie in (0, 1], got {max_fraction}")
    flat = errors.reshape(-1)
    count = min(flat.numel(), math.ceil(max_fraction * flat.numel()))
    values, indices = flat.topk(count, largest=True, sorted=True)
    return indices[values > 0]


def reencode_groups(target: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                    indices: torch.Tensor, beam_size: int,
                    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> torch.Tensor:
    """Beam-search the codes of the groups `indices` toward `target`, in weight space.

    target [out, in] float32, codes [out, G, M] int16, int32 or int64 in [0, K), codebooks [M, K, g]
    floating, scales [out] floating, indices [n] int64 flat group indices (row * G + group)
    -> new codes [out, G, M] in codes' dtype (groups outside `indices` unchanged)
    """
    num_rows, num_groups, num_codebooks = codes.shape
    num_codewords, group_size = codebooks.shape[1:]
    new_codes = codes.clone()
    if indices.numel() == 0:
        return new_codes
    flat_codes = new_codes.view(num_rows * num_groups, num_codebooks)
    group_targets = target.reshape(num_rows * num_groups, group_size)[indices]  # [n, g]
    group_scales = scales[torch.div(indices, num_groups, rounding_mode="floor")].to(target.dtype)  # [n]
    start_codes = flat_codes[indices].long()[:, None, :]  # [n, 1, M]
    identity = torch.eye(group_size, dtype=target.dtype, device=target.device)
    codebooks = codebooks.to(target.dtype)
    chunk = rows_per_chunk(indices.numel(), group_size, beam_size, num_codewords, memory_budget_bytes,
                           target.element_size())
    for first in range(0, indices.numel(), chunk):
        part = slice(first, first + chunk)
        # the torch path: with one group per row a pass is M small stages, nothing to fuse
        found = beam_search_rows(group_targets[part], identity, codebooks, group_scales[part], start_codes[part],
                                 beam_size, use_triton=False)  # [chunk, 1, M]
        flat_codes[indices[part]] = found[:, 0, :].to(flat_codes.dtype)
    return new_codes


@torch.no_grad()
def v_step_layer(layer, max_fraction: float, beam_size: int,
                 memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> int:
    """Re-encode one `PVLinear` toward its straight-through weight [out, in] float32 (its codes
    [out, G, M] change in place); returns how many of the out * G groups changed."""
    return int(v_step_layer_queued(layer, max_fraction, beam_size, memory_budget_bytes))


@torch.no_grad()
def v_step_layer_queued(layer, max_fraction: float, beam_size: int,
                        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                        straight_through: torch.Tensor | None = None) -> torch.Tensor:
    """`v_step_layer` without waiting for the device: returns the changed-group count as a 0-dim
    int64 tensor on the layer's device. The ceil(max_fraction * N) largest-error groups are searched
    whatever their error; those whose error is exactly zero then keep their codes, which is what
    leaving them out (`groups_to_update`) does, without the host reading how many there are
    (a V-step is a few dozen small kernels per layer: one host round trip each would cost more).
    straight_through: the weight [out, in] to move toward, where it is not the layer's own (a
    copy on the card of a host-resident one, `aqflow.pvtune.offload`)."""
    if straight_through is None:
        straight_through = layer.straight_through
    if straight_through is None:
        raise ValueError("the V-step needs the layer's straight-through weight (enable_straight_through)")
    if not 0.0 < max_fraction <= 1.0:
        raise ValueError(f"max_fraction must lie in (0, 1], got {max_fraction}")
    target = straight_through.detach().float()
    errors = group_squared_errors(target, layer.dequantized().float(), layer.group_size)  # [out, G]
    count = min(errors.numel(), math.ceil(max_fraction * errors.numel()))
    indices = errors.reshape(-1).topk(count, largest=True, sorted=False).indices  # a set: the order is not used
    new_codes = reencode_groups(target, layer.codes, layer.codebooks.detach().float(), layer.scales.detach().float(),
                                indices, beam_size, memory_budget_bytes)
    new_codes = torch.where((errors > 0)[..., None], new_codes, layer.codes)
    changed = (new_codes != layer.codes).any(dim=-1).sum()
    layer.codes.copy_(new_codes)
    return changed


def _proposals(layer, max_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's largest group errors of a layer: (errors [count] float32, flat indices
    [count] int64 into the whole layer's out * G groups), count = ceil(max_fraction * out * G),
    padded with error -1 where its rows hold fewer groups."""
    start, stop = layer.rows
    num_groups = layer.codes.shape[1]
    count = math.ceil(max_fraction * layer.codes.shape[0] * num_groups)
    errors = group_squared_errors(layer.straight_through.detach().float(), layer.dequantized_rows().float(),
                                  layer.group_size).reshape(-1)  # [(stop - start) * G]
    values, indices = errors.topk(min(count, errors.numel()), largest=True, sorted=False)
    proposed = torch.full((count,), -1.0, dtype=torch.float32, device=errors.device)
    flat = torch.zeros(count, dtype=torch.int64, device=errors.device)
    proposed[:values.numel()] = values
    flat[:indices.numel()] = indices + start * num_groups
    return proposed, flat


def _gathered(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """Every process's `tensor` [n, ...] stacked: [size, n, ...] (one all-gather)."""
    import torch.distributed as dist

    out = torch.empty(size * tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, tensor.contiguous())
    return out.view(size, *tensor.shape)


@torch.no_grad()
def distributed_v_step(layers, max_fraction: float, beam_size: int,
                       memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> int:
    """The V-step of `layers` (PVLinear, each holding its `rows` of the straight-through weight)
    over every process; returns the number of groups changed in all of them, alike everywhere.

    Two all-gathers: each process's proposals (`_proposals`), from which every process takes the
    same ceil(max_fraction * N) largest errors > 0 of each layer; then each process's new codes of
    its proposals (re-encoded where chosen, unchanged otherwise), which every process writes.
    """
    rank, size = world()
    proposals = [_proposals(layer, max_fraction) for layer in layers]
    counts = [errors.numel() for errors, _ in proposals]
    mine_errors = torch.cat([errors for errors, _ in proposals])
    mine_indices = torch.cat([indices for _, indices in proposals])
    all_errors = _gathered(mine_errors, size)  # [size, proposals]
    all_indices = _gathered(mine_indices, size)
    new_codes = []
    offset = 0
    for layer, count in zip(layers, counts):
        part = slice(offset, offset + count)
        offset += count
        errors = all_errors[:, part]  # [size, count]
        picked = torch.zeros_like(errors, dtype=torch.bool).reshape(-1)
        picked[errors.reshape(-1).topk(count, largest=True, sorted=False).indices] = True
        picked = picked.reshape(size, count) & (errors > 0)
        start, _ = layer.rows
        num_groups = layer.codes.shape[1]
        own = all_indices[rank, part]
        chosen = own[picked[rank]] - start * num_groups  # flat indices into this process's rows
        rows_codes = layer.codes[start:layer.rows[1]]
        updated = reencode_groups(layer.straight_through.detach().float(), rows_codes, layer.codebooks.detach().float(),
                                  layer.scales.detach().float()[start:layer.rows[1]], chosen, beam_size,
                                  memory_budget_bytes)
        flat_rows = updated.reshape(-1, updated.shape[-1])
        local = (own - start * num_groups).clamp(0, max(flat_rows.shape[0] - 1, 0))
        codes = flat_rows[local] if flat_rows.shape[0] else layer.codes.reshape(-1, layer.codes.shape[-1])[own]
        new_codes.append(codes.to(torch.int32))  # [count, M]
    mine_codes = torch.cat(new_codes)
    all_codes = _gathered(mine_codes, size)  # [size, proposals, M]
    changed = 0
    offset = 0
    for layer, count in zip(layers, counts):
        part = slice(offset, offset + count)
        offset += count
        valid = all_errors[:, part] >= 0  # padding proposes nothing
        indices = all_indices[:, part][valid]
        codes = all_codes[:, part][valid]
        flat = layer.codes.view(-1, layer.codes.shape[-1])
        changed += int((flat[indices] != codes).any(dim=-1).sum())
        flat[indices] = codes.to(flat.dtype)
    return changed


class VStep:
    """The V-step of every layer of a student, `v_step_layer_queued` for each in turn.

    On a GPU the whole sequence (a few dozen small kernels per layer; hundreds of layers) is
    recorded as one CUDA graph at its first call, which itself runs eagerly, and every later call
    replays it: the launch overhead, not the arithmetic, is what a V-step costs otherwise. The
    recording holds on to the layers' tensors (codes, codebooks, scales, straight-through weights),
    which training only ever updates in place. Calling returns the number of changed groups.
    """

    def __init__(self, layers, max_fraction: float, beam_size: int,
                 memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, use_graph: bool = True):
        self.layers = list(layers)
        self.settings = (max_fraction, beam_size, memory_budget_bytes)
        # a graph cannot hold the processes' collectives: several processes run it eagerly
        self.use_graph = use_graph and bool(self.layers) and self.layers[0].codes.is_cuda and world()[1] == 1
        self.graph = None
        self.recorded_count = None

    def _every_layer(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.int64, device=self.layers[0].codes.device)
        for layer in self.layers:
            total += v_step_layer_queued(layer, *self.settings)
        return total

    @torch.no_grad()
    def __call__(self) -> int:
        if world()[1] > 1:
            return distributed_v_step(self.layers, *self.settings)
        if not self.use_graph:
            return int(self._every_layer())
        if self.graph is not None:
            self.graph.replay()
            return int(self.recorded_count)
        # the first call is also the warm-up a capture needs (on a side stream); the capture
        # itself only records, so the codes are updated once
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            changed = self._every_layer()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.recorded_count = self._every_layer()
        self.graph = graph
        return int(changed)
