"""Beam search over codes against the full XᵀX.

The beam holds b hypotheses per output row, each a complete code assignment of the row, and
walks the decisions (group j, codebook m) in order: every hypothesis proposes all K codewords for
position (j, m), and the b best distinct rows survive (AQLM's search, so errors in one group can
be compensated by choices in later ones). Rows are independent, so all rows of a chunk move
together: the GPU sees [rows, b, K] tensors, never a Python loop over rows.

Scoring is exact. Before group j every hypothesis still has the original codes in groups >= j,
so a candidate differs from its group-start ancestor ("origin") only in group j. With
p = (W - Ŵ_origin) XᵀX (block j) and the candidate's group reconstruction s(a + c_k), a being
the hypothesis' codeword sum without codebook m, its loss is

    L_origin + eᵀH_jj e - 2 eᵀp,   e = f + s c_k,   f = s a - ŵ_j
  = [L_origin + fᵀH_jj f - 2 fᵀp] + 2 s c_kᵀ(H_jj f - p) + s² c_kᵀH_jj c_k,

so one [rows*b, g+2] x [g+2, K] product per (j, m) scores every candidate. Each hypothesis keeps
its own p. Updating all of it after every group (a rank-g product over `in` columns) reads and
writes [rows, b, in] G times: memory-bound, ~85 % of a pass at in = 8192. Instead the groups are
taken in blocks of B (`block_groups`): inside a block only the block's B·g columns of p are kept
current (rank-g updates on [rows, b, B·g]); at the block's end each surviving hypothesis' changes
in the block, recovered from the back-pointers, update the later columns in one
[rows·b, B·g] x [B·g, after] product (compute-bound, b·out·in² flops per pass in all, in fp32).
The original row is always a candidate, so a pass never increases the objective.

On CUDA the whole pass for a chunk of rows is captured once as a CUDA graph and replayed each
epoch: the pass is thousands of small kernels, and launching them from Python would dominate.
"""

from __future__ import annotations

import torch

from aqflow.quant.beam_kernels import advance_block_columns, beam_stage, follow_back_pointers, triton_stage_supported
from aqflow.quant.cuda_graphs import capture_graph
from aqflow.quant.gather_kernels import codeword_sums
from aqflow.quant.objective import diagonal_blocks

# Groups per block of deferred residual updates: 32 groups of 8 are 256 columns, wide enough
# for the block-end product to run near the card's FP32 rate, small enough that the in-block
# updates stay cheap.
BLOCK_GROUPS = 32


def candidate_table(codebooks: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per codebook and group, the right factor of the scoring product: [c_kᵀ ; 1 ; c_kᵀ H_jj c_k].

    codebooks [M, K, g], blocks [G, g, g] -> [M, G, g+2, K]
    """
    num_codebooks, num_codewords, group_size = codebooks.shape
    num_groups = blocks.shape[0]
    energy = torch.einsum("mkg,jgh,mkh->mjk", codebooks, blocks, codebooks)  # [M, G, K]
    table = torch.empty(num_codebooks, num_groups, group_size + 2, num_codewords, dtype=codebooks.dtype, device=codebooks.device)
    table[:, :, :group_size, :] = codebooks.transpose(1, 2)[:, None]
    table[:, :, group_size, :] = 1
    table[:, :, group_size + 1, :] = energy
    return table


def duplicate_hypotheses(hypotheses: torch.Tensor, origin: torch.Tensor, alive: torch.Tensor, stage: int) -> torch.Tensor:
    """Hypotheses that would expand to the same rows as an earlier live slot: same origin (so the
    same codes outside group j) and the same codes in group j outside position `stage`.

    hypotheses [rows, b, M] (group j's codes), origin [rows, b], alive [rows, b] bool -> [rows, b] bool
    """
    others = torch.cat([hypotheses[..., :stage], hypotheses[..., stage + 1 :]], dim=-1)  # [rows, b, M-1]
    same = (others[:, :, None, :] == others[:, None, :, :]).all(dim=-1)  # [rows, b, b]
    same &= origin[:, :, None] == origin[:, None, :]
    earlier = torch.ones(same.shape[-1], same.shape[-1], dtype=torch.bool, device=same.device).tril(-1)
    return (same & earlier & alive[:, None, :]).any(dim=-1)


def _advance_past_block(
    rest: torch.Tensor,
    xtx_rows: torch.Tensor,
    back_codes: torch.Tensor,
    back_origin: torch.Tensor,
    codebooks: torch.Tensor,
    start_reconstruction: torch.Tensor,
    scale_col: torch.Tensor,
    use_triton: bool = False,
) -> torch.Tensor:
    """residual·XᵀX of the columns after a block, for the hypotheses alive at its end: each one's
    block-start ancestor's row, minus (its changes in the block's groups) · XᵀX[block, after].
    One [R*b, width] x [width, after] product per block instead of a rank-g update per group.

    rest [R, b, after] (block-start hypotheses), xtx_rows [width, after], back_codes [n, R, b, M],
    back_origin [n, R, b] (the block's n groups), codebooks [M, K, g], start_reconstruction [R, n, g],
    scale_col [R, 1, 1], use_triton: follow the back-pointers in one kernel -> [R, b, after]
    """
    num_block_groups, num_rows, beam, num_codebooks = back_codes.shape
    group_size = codebooks.shape[-1]
    slot = torch.arange(beam, device=rest.device).expand(num_rows, beam)
    if use_triton:
        lineage, slot = follow_back_pointers(back_codes, back_origin, slot)
    else:
        lineage = torch.empty(num_rows, beam, num_block_groups, num_codebooks, dtype=torch.int64, device=rest.device)
        for t in reversed(range(num_block_groups)):  # follow each survivor back to the block start
            lineage[:, :, t] = back_codes[t].gather(1, slot[..., None].expand(num_rows, beam, num_codebooks))
            slot = back_origin[t].gather(1, slot)
    new_groups = codeword_sums(lineage.view(num_rows, beam * num_block_groups, num_codebooks), codebooks)
    change = new_groups.view(num_rows, beam, num_block_groups, group_size) * scale_col[..., None] - start_reconstruction[:, None]
    after = rest.gather(1, slot[..., None].expand(num_rows, beam, rest.shape[-1]))  # [R, b, after], contiguous
    after.view(num_rows * beam, -1).addmm_(change.reshape(num_rows * beam, -1), xtx_rows, alpha=-1)
    return after


def beam_search_rows(
    weight: torch.Tensor,
    xtx: torch.Tensor,
    codebooks: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    beam_size: int,
    use_triton: bool | None = None,
    block_groups: int = BLOCK_GROUPS,
) -> torch.Tensor:
    """One beam-search pass over all groups of a chunk of rows. Free of host synchronisation, so it
    can be captured as a CUDA graph. use_triton: run each stage, each group's in-block column
    update and the back-pointer walks as Triton kernels (default: on CUDA where
    `triton_stage_supported`), else as torch operations; both search the same way.
    block_groups: groups per block of deferred residual updates (see the module docstring); the
    search is the same for any value, only the order of floating-point sums differs.

    weight [R, in], xtx [in, in], codebooks [M, K, g], scales [R], codes [R, G, M] int64
    -> new codes [R, G, M] int64 with objective <= that of `codes`
    """
    num_rows, in_features = weight.shape
    num_codebooks, num_codewords, group_size = codebooks.shape
    num_groups = in_features // group_size
    beam = beam_size
    device, dtype = weight.device, weight.dtype
    rows = torch.arange(num_rows, device=device)
    if use_triton is None:
        use_triton = device.type == "cuda" and triton_stage_supported(beam, num_codewords, group_size, device)
    elif use_triton and not triton_stage_supported(beam, num_codewords, group_size, device):
        raise ValueError(f"the Triton stage cannot run on {device} for beam {beam}, K={num_codewords}, g={group_size}")

    sums = codeword_sums(codes, codebooks)  # [R, G, g] unscaled; unchanged until a group is reached
    reconstruction = sums * scales[:, None, None]  # [R, G, g]
    # residual·XᵀX of the columns from the current block on, one per block-start hypothesis
    later = ((weight - reconstruction.reshape(num_rows, in_features)) @ xtx)[:, None, :]  # [R, 1, in]
    later = later.expand(num_rows, beam, in_features)  # [R, b, in]
    blocks = diagonal_blocks(xtx, group_size)  # [G, g, g]
    table = candidate_table(codebooks, blocks)  # [M, G, g+2, K]
    scale_col = scales[:, None, None]  # [R, 1, 1]
    scale_sq = (scales * scales)[:, None, None].expand(num_rows, beam, 1)  # [R, b, 1]
    loss = torch.full((num_rows, beam), float("inf"), dtype=dtype, device=device)  # relative to the start
    loss[:, 0] = 0
    slots = torch.arange(beam, device=device).expand(num_rows, beam)
    back_origin = torch.empty(num_groups, num_rows, beam, dtype=torch.int64, device=device)
    back_codes = torch.empty(num_groups, num_rows, beam, num_codebooks, dtype=torch.int64, device=device)

    for block_start in range(0, num_groups, block_groups):
        block_end = min(num_groups, block_start + block_groups)
        width = (block_end - block_start) * group_size
        block_cols = slice(block_start * group_size, block_end * group_size)
        xtx_block = xtx[block_cols, block_cols]  # [width, width]
        # the block's columns of residual·XᵀX, one per group-start hypothesis; kept current group by group
        p_block = later[:, :, :width].contiguous()  # [R, b, width]
        for j in range(block_start, block_end):
            local = slice((j - block_start) * group_size, (j - block_start + 1) * group_size)
            block = blocks[j]  # [g, g]
            current = reconstruction[:, j, None, :]  # [R, 1, g]
            p_start = p_block[:, :, local]  # [R, b, g] per group-start hypothesis
            origin = slots
            hypotheses = codes[:, j, None, :].expand(num_rows, beam, num_codebooks)  # [R, b, M]
            hyp_sums = sums[:, j, None, :].expand(num_rows, beam, group_size)  # [R, b, g]
            scores = loss
            for m in range(num_codebooks):
                codebook = codebooks[m]  # [K, g]
                if use_triton:  # the last stage writes the group's back-pointers in place
                    last = m == num_codebooks - 1
                    hypotheses, origin, hyp_sums, scores = beam_stage(
                        hyp_sums, hypotheses, origin, scores, p_start, loss, reconstruction[:, j], scales, block,
                        codebook, table[m, j], m, out_codes=back_codes[j] if last else None, out_origin=back_origin[j] if last else None,
                    )
                    continue
                p = p_start.gather(1, origin[..., None].expand(num_rows, beam, group_size))  # [R, b, g]
                rest = hyp_sums - codebook[hypotheses[..., m]]  # [R, b, g]: the sum without codebook m
                f = scale_col * rest - current
                hf = f @ block
                constant = loss.gather(1, origin)[..., None] + (f * (hf - 2 * p)).sum(-1, keepdim=True)  # [R, b, 1]
                linear = (hf - p) * (2 * scale_col)  # [R, b, g]
                lhs = torch.cat([linear, constant, scale_sq], dim=-1)  # [R, b, g+2]
                candidates = (lhs.reshape(num_rows * beam, group_size + 2) @ table[m, j]).view(num_rows, beam, num_codewords)
                finite = torch.isfinite(scores)  # [R, b]
                alive = finite & ~duplicate_hypotheses(hypotheses, origin, finite, m)
                candidates = candidates.masked_fill(~alive[..., None], float("inf"))
                scores, flat_index = candidates.view(num_rows, beam * num_codewords).topk(beam, dim=-1, largest=False)
                parent = torch.div(flat_index, num_codewords, rounding_mode="floor")  # [R, b]
                chosen = flat_index - parent * num_codewords  # [R, b]
                origin = origin.gather(1, parent)
                hypotheses = hypotheses.gather(1, parent[..., None].expand(num_rows, beam, num_codebooks)).clone()
                hypotheses[..., m] = chosen
                hyp_sums = rest.gather(1, parent[..., None].expand(num_rows, beam, group_size)) + codebook[chosen]
            if not use_triton:
                back_origin[j] = origin
                back_codes[j] = hypotheses
            loss = scores
            if j + 1 < block_end and use_triton:  # the block's columns still to be read, in one kernel
                p_block = advance_block_columns(
                    p_block, origin, hyp_sums, reconstruction[:, j], scales, xtx_block[local], (j + 1 - block_start) * group_size
                )
            elif j + 1 < block_end:  # rank-g update of the block's columns only
                change = (hyp_sums * scale_col - current).reshape(num_rows * beam, group_size)  # [R*b, g]
                p_block = p_block.gather(1, origin[..., None].expand(num_rows, beam, width))
                p_block.view(num_rows * beam, width).addmm_(change, xtx_block[local], alpha=-1)
        if block_end < num_groups:
            later = _advance_past_block(
                later[:, :, width:], xtx[block_cols, block_end * group_size :], back_codes[block_start:block_end],
                back_origin[block_start:block_end], codebooks, reconstruction[:, block_start:block_end], scale_col, use_triton,
            )

    slot = loss.argmin(dim=-1)  # [R]
    if use_triton:
        return follow_back_pointers(back_codes, back_origin, slot[:, None])[0].view_as(codes)
    new_codes = torch.empty_like(codes)
    for j in reversed(range(num_groups)):
        new_codes[:, j] = back_codes[j][rows, slot]
        slot = back_origin[j][rows, slot]
    return new_codes


def rows_per_chunk(num_rows: int, in_features: int, beam_size: int, num_codewords: int, memory_budget_bytes: int, element_bytes: int) -> int:
    """How many rows one pass may hold at once: [R, b, K] scores and [R, b, in] per-hypothesis
    residuals dominate, with the [G, R, b, M] back-pointers beside them."""
    per_row = element_bytes * (4 * beam_size * num_codewords + 3 * beam_size * in_features) + 8 * beam_size * in_features
    return max(1, min(num_rows, memory_budget_bytes // per_row))


# Captured passes, shared by every layer of the same shape: capturing costs an eager pass and
# more, and a model has only a handful of distinct linear shapes.
_GRAPH_CACHE: dict[tuple, tuple] = {}


class BeamSearcher:
    """Runs beam-search passes, chunked over rows to a memory budget.

    On CUDA (use_graphs=True) each chunk shape is captured once as a CUDA graph over static
    buffers (weight chunk, XᵀX, codebooks, scales, codes) and replayed on every later pass, of
    this layer and of any other with the same shapes; this removes the Python and launch
    overhead of the many small per-group kernels.
    """

    def __init__(self, xtx: torch.Tensor, beam_size: int, memory_budget_bytes: int, use_graphs: bool = True):
        self.xtx = xtx
        self.beam_size = beam_size
        self.memory_budget_bytes = memory_budget_bytes
        self.use_graphs = use_graphs and xtx.is_cuda

    def __call__(
        self, weight: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, order_seed: int | None = None
    ) -> torch.Tensor:
        """weight [out, in], codebooks [M, K, g], scales [out], codes [out, G, M] -> new codes [out, G, M]

        order_seed: visit the groups and codebooks in a random order drawn from this seed (as AQLM
        does each epoch) instead of 0..G-1, 0..M-1. The objective is invariant under a consistent
        permutation of groups (columns of W, rows and columns of XᵀX, codes) and of codebooks, so
        the pass runs unchanged on permuted inputs and its codes are permuted back.
        """
        if order_seed is not None:
            return self._shuffled(weight, codebooks, scales, codes, order_seed)
        chunk = rows_per_chunk(
            weight.shape[0], weight.shape[1], self.beam_size, codebooks.shape[1], self.memory_budget_bytes, weight.element_size()
        )
        out = torch.empty_like(codes)
        for start in range(0, weight.shape[0], chunk):
            rows = slice(start, min(weight.shape[0], start + chunk))
            run = self._replay if self.use_graphs else self._eager
            out[rows] = run(weight[rows], self.xtx, codebooks, scales[rows], codes[rows])
        return out

    def _shuffled(self, weight, codebooks, scales, codes, order_seed):
        num_rows, num_groups, num_codebooks = codes.shape
        group_size = codebooks.shape[-1]
        generator = torch.Generator().manual_seed(order_seed)
        groups = torch.randperm(num_groups, generator=generator).to(weight.device)
        books = torch.randperm(num_codebooks, generator=generator).to(weight.device)
        permuted_weight = weight.view(num_rows, num_groups, group_size)[:, groups].reshape_as(weight)
        xtx = self.xtx.view(num_groups, group_size, num_groups, group_size)[groups][:, :, groups].reshape_as(self.xtx)
        searcher = BeamSearcher(xtx, self.beam_size, self.memory_budget_bytes, self.use_graphs)
        found = searcher(permuted_weight, codebooks[books], scales, codes[:, groups][:, :, books])
        restored = torch.empty_like(codes)
        restored[:, groups[:, None], books[None, :]] = found
        return restored

    def _eager(self, weight, xtx, codebooks, scales, codes):
        return beam_search_rows(weight, xtx, codebooks, scales, codes, self.beam_size)

    def _replay(self, *inputs):
        key = tuple((tuple(t.shape), t.dtype) for t in inputs) + (self.beam_size, inputs[0].device)
        if key not in _GRAPH_CACHE:
            _GRAPH_CACHE[key] = self._capture(*inputs)
        graph, static_inputs, static_output = _GRAPH_CACHE[key]
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        return static_output.clone()

    def _capture(self, *inputs):
        static_inputs = tuple(t.clone() for t in inputs)
        graph, static_output = capture_graph(lambda: self._eager(*static_inputs), lambda: self._eager(*static_inputs))
        return graph, static_inputs, static_output
