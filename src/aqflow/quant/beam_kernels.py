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
        energy_ptr,  # c_kᵀ H_jj c_k [K]
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

        codebook = tl.load(codebook_ptr + kk[:, None] * G + gi[None, :])  # [K, G]
        energy = tl.load(energy_ptr + kk)  # [K]
        scores = constant[:, None] + tl.sum(linear[:, None, :] * codebook[None, :, :], axis=2) + (s * s) * energy[None, :]
        scores = tl.where(alive[:, None], scores, inf)

        # the b best candidates: b rounds of one (min, argmin) reduction over registers; the
        # survivors' gathers come after, all at once (one round of global-load latency, not b)
        flat = tl.reshape(scores, (BLOCK_B * K,))
        flat_index = tl.arange(0, BLOCK_B * K)
        picks = tl.zeros([BLOCK_B], tl.int32)
        bests = tl.full([BLOCK_B], inf, flat.dtype)
        for t in tl.static_range(BEAM):
            best, pick = tl.min(flat, axis=0, return_indices=True, return_indices_tie_break_left=True)
            flat = tl.where(flat_index == pick, inf, flat)
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
    energy: torch.Tensor,
    stage: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stage for all rows.

    sums [R, b, g], codes [R, b, M] int64, origin [R, b] int64, scores [R, b] (contiguous),
    p_start [R, b, g], loss [R, b] (contiguous), current [R, g], scales [R], block [g, g],
    codebook [K, g], energy [K]  ->  new (codes [R, b, M], origin [R, b], sums [R, b, g], scores [R, b])
    Views with a zero slot stride (a broadcast group start) are read as they are.
    """
    num_rows, beam, group_size = sums.shape
    num_codebooks = codes.shape[-1]
    num_codewords = codebook.shape[0]
    for name, tensor in (("sums", sums), ("codes", codes), ("p_start", p_start), ("current", current)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"beam_stage needs a contiguous last dimension in {name}")
    out_sums = torch.empty(num_rows, beam, group_size, dtype=sums.dtype, device=sums.device)
    out_codes = torch.empty(num_rows, beam, num_codebooks, dtype=torch.int64, device=sums.device)
    out_origin = torch.empty(num_rows, beam, dtype=torch.int64, device=sums.device)
    out_scores = torch.empty(num_rows, beam, dtype=sums.dtype, device=sums.device)
    _beam_stage_kernel[(num_rows,)](
        sums, sums.stride(0), sums.stride(1),
        codes, codes.stride(0), codes.stride(1),
        origin, origin.stride(0), origin.stride(1),
        scores.contiguous(),
        p_start, p_start.stride(0), p_start.stride(1),
        loss.contiguous(),
        current, current.stride(0),
        scales.contiguous(), block.contiguous(), codebook.contiguous(), energy.contiguous(),
        out_sums, out_codes, out_origin, out_scores,
        BEAM=beam, BLOCK_B=next_power_of_two(beam), K=num_codewords, G=group_size, M=num_codebooks, STAGE=stage,
    )
    return out_codes, out_origin, out_sums, out_scores
