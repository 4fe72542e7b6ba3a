"""Nearest codeword for many points in one Triton kernel, without materialising [N, K] distances.

Both assignments in the quantizer have the form
    code(n) = argmin_k  bias[n mod P, k] - 2 a_n · c_k
(Euclidean: a = x, bias = |c_k|², P = 1; Mahalanobis under H_j: a = H_j w, bias[j] = c_kᵀH_j c_k,
P = G with points laid out row-major over [rows, G]). The torch version writes and re-reads an
[N, K] matrix several times per k-means iteration; this kernel keeps a running minimum per point.
"""

from __future__ import annotations

import torch

from aqflow.quant.beam_kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _nearest_kernel(
        a_ptr, bias_ptr, centroids_ptr, codes_ptr, best_ptr, num_points, bias_period,
        K: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = n < num_points
        gi = tl.arange(0, G_PAD)
        in_group = gi < G
        period_row = n % bias_period
        a = tl.load(a_ptr + n[:, None] * G + gi[None, :], mask=valid[:, None] & in_group[None, :], other=0.0)  # [BLOCK_N, G_PAD]
        best = tl.full([BLOCK_N], float("inf"), tl.float32)
        arg = tl.zeros([BLOCK_N], tl.int64)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            centroids_t = tl.load(centroids_ptr + kk[None, :] * G + gi[:, None], mask=in_group[:, None], other=0.0)  # [G_PAD, BLOCK_K]
            # "ieee": full float32 products; tf32 would flip near-tie assignments
            dots = tl.dot(a, centroids_t, input_precision="ieee")
            acc = tl.load(bias_ptr + period_row[:, None] * K + kk[None, :], mask=valid[:, None], other=0.0) - 2.0 * dots
            chunk_best = tl.min(acc, axis=1)
            chunk_arg = tl.argmin(acc, axis=1).to(tl.int64) + k0
            better = chunk_best < best
            best = tl.where(better, chunk_best, best)
            arg = tl.where(better, chunk_arg, arg)
        tl.store(codes_ptr + n, arg, mask=valid)
        tl.store(best_ptr + n, best, mask=valid)


def nearest_fused_supported(num_centroids: int, group_size: int, device: torch.device) -> bool:
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return triton is not None and device.type == "cuda" and pow2(num_centroids) and num_centroids >= 16 and pow2(group_size)


def nearest_fused(a: torch.Tensor, bias: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin_k bias[n mod P, k] - 2 a_n·c_k and its value.

    a [N, g], bias [P, K] (N divisible by P), centroids [K, g] (K >= 16, powers of two) -> codes [N] int64, minimum [N] float32
    """
    num_points, group_size = a.shape
    num_centroids = centroids.shape[0]
    codes = torch.empty(num_points, dtype=torch.int64, device=a.device)
    best = torch.empty(num_points, dtype=torch.float32, device=a.device)
    block_n, block_k = 64, min(64, num_centroids)
    _nearest_kernel[(triton.cdiv(num_points, block_n),)](
        a.contiguous(), bias.contiguous(), centroids.contiguous(), codes, best, num_points, bias.shape[0],
        K=num_centroids, G=group_size, G_PAD=max(16, group_size), BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return codes, best
