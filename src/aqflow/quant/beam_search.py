"""Beam search over codes against the full XᵀX.

One pass visits the column groups j = 0..G-1 of every row at once (rows are independent; all
rows of a chunk move together, so the GPU sees [rows, beam, K] tensors, never a Python loop over
rows). For group j, with every other group held at its current codes, the loss change of giving
group j the unscaled reconstruction v is exact and quadratic:

    Δ(v) = eᵀ H_jj e - 2 eᵀ p_j,   e = s v - ŵ_j,   p = (W - Ŵ) XᵀX  (row vector, block j),

so errors of group j are weighed against all other groups through p. Changing codeword m of a
hypothesis with current sum a + c_old to a + c_k gives, with f = s a - ŵ_j,

    Δ = [fᵀH f - 2 fᵀp] + 2 s c_kᵀ(H f - p) + s² c_kᵀ H c_k,

i.e. one [rows*beam, g+2] x [g+2, K] product per codebook per group scores every candidate.
The beam keeps the b best distinct code tuples; the original tuple is a candidate at every
stage, so a pass never increases the objective. After group j is chosen, p is updated by a
rank-g product (the pass's only O(out·in²) work in total).

On CUDA the whole pass for a chunk of rows is captured once as a CUDA graph and replayed each
epoch: the pass is thousands of small kernels, and launching them from Python would dominate.
"""

from __future__ import annotations

import torch

from aqflow.quant.objective import diagonal_blocks
from aqflow.quant.representation import group_reconstruction


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


def duplicate_hypotheses(hypotheses: torch.Tensor, alive: torch.Tensor, stage: int) -> torch.Tensor:
    """Hypotheses whose codes outside position `stage` repeat an earlier live slot's: they would
    expand to the same candidates, so only the first of them may expand.

    hypotheses [rows, b, M], alive [rows, b] bool -> [rows, b] bool
    """
    others = torch.cat([hypotheses[..., :stage], hypotheses[..., stage + 1 :]], dim=-1)  # [rows, b, M-1]
    same = (others[:, :, None, :] == others[:, None, :, :]).all(dim=-1)  # [rows, b, b]
    earlier = torch.ones(same.shape[-1], same.shape[-1], dtype=torch.bool, device=same.device).tril(-1)
    return (same & earlier & alive[:, None, :]).any(dim=-1)


def beam_search_rows(
    weight: torch.Tensor,
    xtx: torch.Tensor,
    codebooks: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    beam_size: int,
) -> torch.Tensor:
    """One beam-search pass over all groups of a chunk of rows. Free of host synchronisation, so it
    can be captured as a CUDA graph.

    weight [R, in], xtx [in, in], codebooks [M, K, g], scales [R], codes [R, G, M] int64
    -> new codes [R, G, M] int64 with objective <= that of `codes`
    """
    num_rows, in_features = weight.shape
    num_codebooks, num_codewords, group_size = codebooks.shape
    num_groups = in_features // group_size
    beam = beam_size
    rows = torch.arange(num_rows, device=weight.device)

    sums = group_reconstruction(codes, codebooks)  # [R, G, g] unscaled
    reconstruction = sums * scales[:, None, None]  # [R, G, g]
    residual_xtx = (weight - reconstruction.reshape(num_rows, in_features)) @ xtx  # [R, in]
    p_groups = residual_xtx.view(num_rows, num_groups, group_size)
    table = candidate_table(codebooks, diagonal_blocks(xtx, group_size))  # [M, G, g+2, K]
    scale_col = scales[:, None, None]  # [R, 1, 1]
    scale_sq = (scales * scales)[:, None, None].expand(num_rows, beam, 1)  # [R, b, 1]
    start_scores = torch.full((num_rows, beam), float("inf"), dtype=weight.dtype, device=weight.device)
    start_scores[:, 0] = 0
    new_codes = codes.clone()

    for j in range(num_groups):
        block = xtx[j * group_size : (j + 1) * group_size, j * group_size : (j + 1) * group_size]  # [g, g]
        current = reconstruction[:, j, None, :]  # [R, 1, g]
        p = p_groups[:, j, None, :]  # [R, 1, g]
        hypotheses = new_codes[:, j, None, :].expand(num_rows, beam, num_codebooks)  # [R, b, M]
        hyp_sums = sums[:, j, None, :].expand(num_rows, beam, group_size)  # [R, b, g]
        scores = start_scores
        for m in range(num_codebooks):
            codebook = codebooks[m]  # [K, g]
            rest = hyp_sums - codebook[hypotheses[..., m]]  # [R, b, g]: the sum without codebook m
            f = scale_col * rest - current
            hf = f @ block
            constant = (f * (hf - 2 * p)).sum(-1, keepdim=True)  # [R, b, 1]
            linear = (hf - p) * (2 * scale_col)  # [R, b, g]
            lhs = torch.cat([linear, constant, scale_sq], dim=-1)  # [R, b, g+2]
            candidates = (lhs.reshape(num_rows * beam, group_size + 2) @ table[m, j]).view(num_rows, beam, num_codewords)
            finite = torch.isfinite(scores)  # [R, b]
            alive = finite & ~duplicate_hypotheses(hypotheses, finite, m)
            candidates = candidates.masked_fill(~alive[..., None], float("inf"))
            scores, flat_index = candidates.view(num_rows, beam * num_codewords).topk(beam, dim=-1, largest=False)
            parent = torch.div(flat_index, num_codewords, rounding_mode="floor")  # [R, b]
            chosen = flat_index - parent * num_codewords  # [R, b]
            hypotheses = hypotheses.gather(1, parent[..., None].expand(num_rows, beam, num_codebooks)).clone()
            hypotheses[..., m] = chosen
            hyp_sums = rest.gather(1, parent[..., None].expand(num_rows, beam, group_size)) + codebook[chosen]
        best = scores.argmin(dim=-1)  # [R]
        best_sum = hyp_sums[rows, best]  # [R, g]
        change = best_sum * scales[:, None] - reconstruction[:, j]  # [R, g]
        residual_xtx.addmm_(change, xtx[j * group_size : (j + 1) * group_size], alpha=-1)
        reconstruction[:, j] = best_sum * scales[:, None]
        sums[:, j] = best_sum
        new_codes[:, j] = hypotheses[rows, best]
    return new_codes


def rows_per_chunk(num_rows: int, in_features: int, beam_size: int, num_codewords: int, memory_budget_bytes: int, element_bytes: int) -> int:
    """How many rows one pass may hold at once: the [R, b, K] score tensors dominate, with a few
    [R, in] tensors beside them."""
    per_row = element_bytes * (4 * beam_size * num_codewords + 6 * in_features)
    return max(1, min(num_rows, memory_budget_bytes // per_row))


class BeamSearcher:
    """Runs beam-search passes for one layer, chunked over rows to a memory budget.

    On CUDA (use_graphs=True) each chunk shape is captured once as a CUDA graph over static
    buffers and replayed on every later pass, which removes the Python and launch overhead of the
    many small per-group kernels.
    """

    def __init__(self, xtx: torch.Tensor, beam_size: int, memory_budget_bytes: int, use_graphs: bool = True):
        self.xtx = xtx
        self.beam_size = beam_size
        self.memory_budget_bytes = memory_budget_bytes
        self.use_graphs = use_graphs and xtx.is_cuda
        self._graphs: dict[int, tuple] = {}

    def __call__(self, weight: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """weight [out, in], codebooks [M, K, g], scales [out], codes [out, G, M] -> new codes [out, G, M]"""
        chunk = rows_per_chunk(
            weight.shape[0], weight.shape[1], self.beam_size, codebooks.shape[1], self.memory_budget_bytes, weight.element_size()
        )
        out = torch.empty_like(codes)
        for start in range(0, weight.shape[0], chunk):
            rows = slice(start, min(weight.shape[0], start + chunk))
            run = self._replay if self.use_graphs else self._eager
            out[rows] = run(weight[rows], codebooks, scales[rows], codes[rows])
        return out

    def _eager(self, weight, codebooks, scales, codes):
        return beam_search_rows(weight, self.xtx, codebooks, scales, codes, self.beam_size)

    def _replay(self, weight, codebooks, scales, codes):
        key = weight.shape[0]
        if key not in self._graphs:
            self._graphs[key] = self._capture(weight, codebooks, scales, codes)
        graph, static_inputs, static_output = self._graphs[key]
        for buffer, value in zip(static_inputs, (weight, codebooks, scales, codes)):
            buffer.copy_(value)
        graph.replay()
        return static_output.clone()

    def _capture(self, weight, codebooks, scales, codes):
        static_inputs = tuple(t.clone() for t in (weight, codebooks, scales, codes))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: cuBLAS handles, allocator pools
            self._eager(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = self._eager(*static_inputs)
        return graph, static_inputs, static_output
