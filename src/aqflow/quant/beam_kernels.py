"""One beam-search stage (group j, codebook m) as a single Triton kernel, one program per row.

The torch formulation of a stage (`beam_search.beam_search_rows`) is ~45 small kernels; on a
GPU each costs a few microseconds whatever its size, so a pass over a 576x576 layer spent most
of its time launching. Here one program per output row does the whole stage in registers:

    1. candidate scores  [b, K] = const_h + Σ_i lin_h[i] · C[k, i] + s² · E_k   (see beam_search.py)
       with dead or duplicate hypotheses masked to +inf;
    2. the b smallest of the b·K candidates, by b rounds of (min with its index, mask);
    3. the survivors' codes, origins and group sums, gathered from the inputs in one vector step
       (gathering inside each round put b rounds of dependent global loads on every program's path:
       ~31 µs a stage for 1024 rows of a 3072x8192 layer on an H100, under one wave of programs).

Duplicate rule, scores and tie order follow the torch stage, so both compute the same search.
Used on CUDA when K·b is small enough for registers (K=256, b<=16 at 8-bit codebooks); the torch
stage serves every other case. Tests run it on the CPU through Triton's interpreter.

Beside it, the pass's two other per-group steps on the Triton path: the block's columns of
residual·XᵀX advanced past a group (`advance_block_columns`), and the walk back along the
back-pointers (`follow_back_pointers`), each one kernel where torch needed a gather and a product,
or two gathers per group.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: without it (or without a GPU) the torch stage runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

MAX_REGISTER_CANDIDATES = 4096  # b·K held per program
# Warps per row of the stage kernel. The stage is latency-bound (b dependent selection rounds per
# row): fewer warps per row let more rows share an SM. One beam pass over 8192x3072 on an H100:
# 0.115 s at 1 warp, 0.110 s at 2, 0.252 s at 4, 0.402 s at 8 (benchmarks/beam_pass.py --sweep, in the git history).
STAGE_NUM_WARPS = 2


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_stage_supported(beam_size: int, num_codewords: int, group_size: int, device: torch.device) -> bool:
    """Whether `beam_stage` can run here for these sizes (on the CPU only under TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return pow2(num_codewords) and pow2(group_size) and next_power_of_two(beam_size) * num_codewords <= MAX_REGISTER_CANDIDATES


if triton is not None:

    @triton.jit
    def _beam_stage_kernel(
        sums_ptr, sums_rs, sums_ss,  # hypotheses' codeword sums of group j [R, b, g] (row, slot strides; g contiguous)
        codes_ptr, codes_rs, codes_ss,  # hypotheses' codes of group j [R, b, M]
        origin_ptr, origin_rs, origin_ss,  # group-start slot each hypothesis descends from [R, b]
        scores_ptr,  # hypotheses' scores [R, b] contiguous (inf = dead)
        p_ptr, p_rs, p_ss,  # group-start residual·XᵀX, block j [R, b, g]
        loss_ptr,  # group-start losses [R, b] contiguous
        current_ptr, current_rs,  # reconstruction of group j at the pass start [R, g]
        scales_ptr,  # [R]
        block_ptr,  # XᵀX block (j, j) [g, g] contiguous
        codebook_ptr,  # codebook m [K, g] contiguous
        table_ptr,  # [c_kᵀ ; 1 ; c_kᵀ H_jj c_k] of (m, j) [g+2, K] contiguous (beam_search.candidate_table)
        out_sums_ptr, out_codes_ptr, out_origin_ptr, out_scores_ptr,  # contiguous [R, b, g], [R, b, M], [R, b], [R, b]
        BEAM: tl.constexpr,
        BLOCK_B: tl.constexpr,
        K: tl.constexpr,
        G: tl.constexpr,
        M: tl.constexpr,
        STAGE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_B)
        gi = tl.arange(0, G)
        kk = tl.arange(0, K)
        slot_ok = h < BEAM
        inf = float("inf")

        s = tl.load(scales_ptr + row)
        origin = tl.load(origin_ptr + row * origin_rs + h * origin_ss, mask=slot_ok, other=0)
        score_in = tl.load(scores_ptr + row * BEAM + h, mask=slot_ok, other=inf)
        code_m = tl.load(codes_ptr + row * codes_rs + h * codes_ss + STAGE, mask=slot_ok, other=0)

        # Dead and duplicate hypotheses do not expand (a duplicate has an earlier live slot with the
        # same origin and the same codes outside position STAGE).
        same = origin[:, None] == origin[None, :]
        for mm in tl.static_range(M):
            if mm != STAGE:
                c = tl.load(codes_ptr + row * codes_rs + h * codes_ss + mm, mask=slot_ok, other=0)
                same = same & (c[:, None] == c[None, :])
        finite = score_in < inf
        earlier = h[None, :] < h[:, None]
        duplicate = tl.max((same & earlier & finite[None, :]).to(tl.int32), axis=1) > 0
        alive = finite & (duplicate == 0) & slot_ok

        # f = s·(sum without codebook m) - ŵ_j ; hf = f H_jj ; p = group-start residual·H of the origin
        bg = h[:, None] * 0 + gi[None, :]
        sums = tl.load(sums_ptr + row * sums_rs + h[:, None] * sums_ss + gi[None, :], mask=slot_ok[:, None], other=0.0)
        old = tl.load(codebook_ptr + code_m[:, None] * G + bg, mask=slot_ok[:, None], other=0.0)
        current = tl.load(current_ptr + row * current_rs + gi)
        f = s * (sums - old) - current[None, :]  # [B, G]
        block = tl.load(block_ptr + gi[:, None] * G + gi[None, :])  # [G, G]
        hf = tl.sum(f[:, :, None] * block[None, :, :], axis=1)  # [B, G]
        p = tl.load(p_ptr + row * p_rs + origin[:, None] * p_ss + gi[None, :], mask=slot_ok[:, None], other=0.0)
        loss0 = tl.load(loss_ptr + row * BEAM + origin, mask=slot_ok, other=0.0)
        constant = loss0 + tl.sum(f * (hf - 2.0 * p), axis=1)  # [B]
        linear = 2.0 * s * (hf - p)  # [B, G]

        # scores as b·K accumulators, one codebook coordinate at a time: a [b, K, g] product
        # in registers (and its reduction) would cost g times the registers and limit how many
        # rows an SM works on at once; the stage is latency-bound, so occupancy is its speed.
        energy = tl.load(table_ptr + (G + 1) * K + kk)  # [K]
        scores = constant[:, None] + (s * s) * energy[None, :]
        for i in tl.static_range(G):
            linear_i = tl.sum(tl.where(gi[None, :] == i, linear, 0.0), axis=1)  # [B]
            scores += linear_i[:, None] * tl.load(table_ptr + i * K + kk)[None, :]
        scores = tl.where(alive[:, None], scores, inf)

        # the b best candidates: b rounds of (min, argmin) reductions over registers; the
        # survivors' gathers come after, all at once (one round of global-load latency, not b)
        picks = tl.zeros([BLOCK_B], tl.int32)
        bests = tl.full([BLOCK_B], inf, scores.dtype)
        # per hypothesis first (lowest codeword index on ties), then over hypotheses (lowest slot
        # on ties): the flat order's leftmost minimum, without reshaping the scores (at 2 warps a
        # row, the fastest setting, a flat selection over reshaped scores was 5 % slower, H100)
        flat_index = h[:, None] * K + kk[None, :]
        for t in tl.static_range(BEAM):
            row_best, row_pick = tl.min(scores, axis=1, return_indices=True, return_indices_tie_break_left=True)
            best, slot = tl.min(row_best, axis=0, return_indices=True, return_indices_tie_break_left=True)
            pick = slot * K + tl.sum(tl.where(h == slot, row_pick, 0), axis=0)
            scores = tl.where(flat_index == pick, inf, scores)
            picks = tl.where(h == t, pick, picks)
            bests = tl.where(h == t, best, bests)
        parent = tl.minimum(picks // K, BEAM - 1)  # an all-inf tail may point past the live slots
        chosen = (picks % K).to(tl.int64)
        out = row * BEAM + h
        tl.store(out_scores_ptr + out, bests, mask=slot_ok)
        tl.store(out_origin_ptr + out, tl.load(origin_ptr + row * origin_rs + parent * origin_ss, mask=slot_ok, other=0), mask=slot_ok)
        for mm in tl.static_range(M):
            if mm == STAGE:
                tl.store(out_codes_ptr + out * M + mm, chosen, mask=slot_ok)
            else:
                tl.store(out_codes_ptr + out * M + mm, tl.load(codes_ptr + row * codes_rs + parent * codes_ss + mm, mask=slot_ok, other=0), mask=slot_ok)
        parent_code = tl.load(codes_ptr + row * codes_rs + parent * codes_ss + STAGE, mask=slot_ok, other=0)
        new_sum = (
            tl.load(sums_ptr + row * sums_rs + parent[:, None] * sums_ss + gi[None, :], mask=slot_ok[:, None], other=0.0)
            - tl.load(codebook_ptr + parent_code[:, None] * G + gi[None, :], mask=slot_ok[:, None], other=0.0)
            + tl.load(codebook_ptr + chosen[:, None] * G + gi[None, :], mask=slot_ok[:, None], other=0.0)
        )
        tl.store(out_sums_ptr + out[:, None] * G + gi[None, :], new_sum, mask=slot_ok[:, None])


    @triton.jit
    def _block_columns_kernel(
        p_ptr,  # the block's columns of residual·XᵀX, one per group-start hypothesis [R, b, W] contiguous
        origin_ptr,  # group-start slot of each survivor [R, b] contiguous
        sums_ptr,  # survivors' codeword sums of group j [R, b, g] contiguous
        current_ptr, current_rs,  # reconstruction of group j at the pass start [R, g]
        scales_ptr,  # [R]
        rows_ptr, rows_rs,  # XᵀX rows of group j, the block's columns [g, W]
        out_ptr,  # [R, b, W] contiguous; columns before start_col are left unwritten
        start_col,
        W,
        BEAM: tl.constexpr,
        BLOCK_B: tl.constexpr,
        G: tl.constexpr,
        TILE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_B)
        cols = start_col + tl.arange(0, TILE)
        slot_ok = h < BEAM
        col_ok = cols < W
        both = slot_ok[:, None] & col_ok[None, :]
        s = tl.load(scales_ptr + row)
        origin = tl.load(origin_ptr + row * BEAM + h, mask=slot_ok, other=0)
        acc = tl.load(p_ptr + (row * BEAM + origin[:, None]) * W + cols[None, :], mask=both, other=0.0)
        for i in tl.static_range(G):
            change = s * tl.load(sums_ptr + (row * BEAM + h) * G + i, mask=slot_ok, other=0.0) - tl.load(current_ptr + row * current_rs + i)
            acc -= change[:, None] * tl.load(rows_ptr + i * rows_rs + cols, mask=col_ok, other=0.0)[None, :]
        tl.store(out_ptr + (row * BEAM + h[:, None]) * W + cols[None, :], acc, mask=both)


    @triton.jit
    def _follow_back_pointers_kernel(
        back_codes_ptr,  # [n, R, b, M] contiguous
        back_origin_ptr,  # [n, R, b] contiguous
        start_ptr,  # slot after the last step [R, S] contiguous
        out_codes_ptr,  # [R, S, n, M] contiguous
        out_slot_ptr,  # slot before the first step [R, S] contiguous
        num_rows,
        num_starts,
        NUM_STEPS: tl.constexpr,  # a loop bound (not unrolled); constexpr so the interpreter can run it
        BEAM: tl.constexpr,
        M: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        lineage = tl.program_id(0).to(tl.int64)  # row * S + start
        row = lineage // num_starts
        mi = tl.arange(0, BLOCK_M)
        m_ok = mi < M
        slot = tl.load(start_ptr + lineage)
        for t in range(NUM_STEPS):
            step = NUM_STEPS - 1 - t
            entry = (step * num_rows + row) * BEAM + slot
            codes = tl.load(back_codes_ptr + entry * M + mi, mask=m_ok, other=0)
            tl.store(out_codes_ptr + (lineage * NUM_STEPS + step) * M + mi, codes, mask=m_ok)
            slot = tl.load(back_origin_ptr + entry)
        tl.store(out_slot_ptr + lineage, slot)


def follow_back_pointers(back_codes: torch.Tensor, back_origin: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each lineage's codes over n steps of the search, read backwards from its slot after the
    last step, one program per lineage (a chain of n dependent loads); the torch loop is two
    small gathers per step, 2·n launches.

    back_codes [n, R, b, M] int64, back_origin [n, R, b] int64, start [R, S] int64
    -> (codes [R, S, n, M] int64, slot before the first step [R, S] int64)
    """
    num_steps, num_rows, beam, num_codebooks = back_codes.shape
    num_starts = start.shape[1]
    if not (back_codes.is_contiguous() and back_origin.is_contiguous()):
        raise ValueError("follow_back_pointers needs contiguous back_codes and back_origin")
    codes = torch.empty(num_rows, num_starts, num_steps, num_codebooks, dtype=torch.int64, device=back_codes.device)
    first_slot = torch.empty(num_rows, num_starts, dtype=torch.int64, device=back_codes.device)
    _follow_back_pointers_kernel[(num_rows * num_starts,)](
        back_codes, back_origin, start.contiguous(), codes, first_slot, num_rows, num_starts,
        NUM_STEPS=num_steps, BEAM=beam, M=num_codebooks, BLOCK_M=next_power_of_two(num_codebooks), num_warps=1,
    )
    return codes, first_slot


def advance_block_columns(
    p_block: torch.Tensor, origin: torch.Tensor, sums: torch.Tensor, current: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, start_col: int
) -> torch.Tensor:
    """The block's columns of residual·XᵀX after group j, for its survivors: each one's
    group-start row minus its change in group j times XᵀX[group j, block]. One pass over the
    columns still to be read (from start_col on), where gather + addmm made four over all of them.

    p_block [R, b, W] contiguous, origin [R, b], sums [R, b, g] (survivors' unscaled codeword sums),
    current [R, g], scales [R], rows [g, W] -> [R, b, W], columns < start_col undefined
    """
    num_rows, beam, width = p_block.shape
    group_size = sums.shape[-1]
    if not (p_block.is_contiguous() and sums.is_contiguous() and current.stride(-1) == 1 and rows.stride(-1) == 1):
        raise ValueError("advance_block_columns needs contiguous p_block and sums and contiguous last dimensions")
    out = torch.empty_like(p_block)
    _block_columns_kernel[(num_rows,)](
        p_block, origin.contiguous(), sums, current, current.stride(0), scales.contiguous(), rows, rows.stride(0), out,
        start_col, width, BEAM=beam, BLOCK_B=next_power_of_two(beam), G=group_size, TILE=next_power_of_two(width - start_col),
    )
    return out


def beam_stage(
    sums: torch.Tensor,
    codes: torch.Tensor,
    origin: torch.Tensor,
    scores: torch.Tensor,
    p_start: torch.Tensor,
    loss: torch.Tensor,
    current: torch.Tensor,
    scales: torch.Tensor,
    block: torch.Tensor,
    codebook: torch.Tensor,
    table: torch.Tensor,
    stage: int,
    num_warps: int | None = None,
    out_codes: torch.Tensor | None = None,
    out_origin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stage for all rows.

    sums [R, b, g], codes [R, b, M] int64, origin [R, b] int64, scores [R, b] (contiguous),
    p_start [R, b, g], loss [R, b] (contiguous), current [R, g], scales [R], block [g, g],
    codebook [K, g], table [g+2, K] (the stage's `candidate_table` slice)  ->  new (codes [R, b, M], origin [R, b], sums [R, b, g], scores [R, b])
    Views with a zero slot stride (a broadcast group start) are read as they are. out_codes and
    out_origin, contiguous, receive the new codes and origins (the back-pointers, without a copy).
    """
    num_rows, beam, group_size = sums.shape
    num_codebooks = codes.shape[-1]
    num_codewords = codebook.shape[0]
    for name, tensor in (("sums", sums), ("codes", codes), ("p_start", p_start), ("current", current)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"beam_stage needs a contiguous last dimension in {name}")
    out_sums = torch.empty(num_rows, beam, group_size, dtype=sums.dtype, device=sums.device)
    if out_codes is None:
        out_codes = torch.empty(num_rows, beam, num_codebooks, dtype=torch.int64, device=sums.device)
    if out_origin is None:
        out_origin = torch.empty(num_rows, beam, dtype=torch.int64, device=sums.device)
    if not (out_codes.is_contiguous() and out_origin.is_contiguous()):
        raise ValueError("beam_stage writes only into contiguous out_codes and out_origin")
    out_scores = torch.empty(num_rows, beam, dtype=sums.dtype, device=sums.device)
    _beam_stage_kernel[(num_rows,)](
        sums, sums.stride(0), sums.stride(1),
        codes, codes.stride(0), codes.stride(1),
        origin, origin.stride(0), origin.stride(1),
        scores.contiguous(),
        p_start, p_start.stride(0), p_start.stride(1),
        loss.contiguous(),
        current, current.stride(0),
        scales.contiguous(), block.contiguous(), codebook.contiguous(), table.contiguous(),
        out_sums, out_codes, out_origin, out_scores,
        BEAM=beam, BLOCK_B=next_power_of_two(beam), K=num_codewords, G=group_size, M=num_codebooks, STAGE=stage,
        num_warps=num_warps or STAGE_NUM_WARPS,
    )
    return out_codes, out_origin, out_sums, out_scores
