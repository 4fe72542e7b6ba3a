"""Codebook initialisations, selectable by name: `greedy` (residual k-means) and `oaem` (OA-EM).

Both fit the codebooks one after another on what the earlier ones left (the residual). OA-EM
refines each k-means codebook by R rounds of
    M-step: S Adam steps on  mean_i e_iᵀ H_i e_i,  e_i = w_i - c_{b_i}, H_i the damped diagonal block
            of XᵀX of group i's columns, lr cosine-annealed from eta to 0.1 eta;
    E-step: b_i <- argmin_k (w_i - c_k)ᵀ H_i (w_i - c_k)   (Mahalanobis reassignment),
so that codewords go where the output is sensitive, not where weights are merely large.
Points are row-normalised weight groups (the scales are factored out first, as AQLM does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from aqflow.quant.cuda_graphs import capture_graph
from aqflow.quant.kmeans import fit_kmeans, nearest_mahalanobis, reseed_empty_clusters
from aqflow.quant.representation import GROUP_SIZE


@dataclass(frozen=True)
class InitSettings:
    """What the initialisations read. `oaem_*` are ignored by `greedy`."""

    num_codebooks: int
    nbits: int
    group_size: int = GROUP_SIZE
    kmeans_max_iter: int = 1000
    kmeans_tolerance: float = 2e-4
    oaem_rounds: int = 3
    oaem_steps: int = 100
    oaem_lr: float = 1e-4
    oaem_damping: float = 0.01


def oaem_objective(groups: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, metrics: torch.Tensor) -> torch.Tensor:
    """mean_i e_iᵀ H_i e_i (paper, eq. 3).

    groups [rows, G, g], centroids [K, g], codes [rows, G], metrics [G, g, g] -> scalar
    """
    error = groups - centroids[codes]  # [rows, G, g]
    return torch.einsum("rjg,jgh,rjh->", error, metrics, error) / codes.numel()


def cosine_lr(step: int, total_steps: int, lr: float, final_ratio: float = 0.1) -> float:
    """Cosine annealing from lr (step 0) to final_ratio * lr (after the last step)."""
    floor = final_ratio * lr
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * step / max(1, total_steps)))


def quadratic_adam_steps(
    centroids: torch.Tensor, curvature: torch.Tensor, pull: torch.Tensor, scale: float, steps: int, lr: float,
    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
) -> torch.Tensor:
    """Adam (torch's defaults) with the cosine schedule on  scale/2 · Σ_k c_kᵀA_k c_k - 2 c_kᵀb_k,
    whose gradient is scale·(A_k c_k - b_k). Every constant is a Python float known in advance,
    so the loop can be captured as a CUDA graph.

    centroids [K, g], curvature A [K, g, g], pull b [K, g] -> centroids [K, g]
    """
    beta1, beta2 = betas
    centroids = centroids.clone()
    exp_avg = torch.zeros_like(centroids)
    exp_avg_sq = torch.zeros_like(centroids)
    for step in range(steps):
        grad = scale * (torch.bmm(curvature, centroids[:, :, None])[:, :, 0] - pull)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** (step + 1))).add_(eps)
        centroids.addcdiv_(exp_avg, denom, value=-cosine_lr(step, steps, lr) / (1 - beta1 ** (step + 1)))
    return centroids


# Captured M-step loops by (K, g, steps, lr, dtype, device); see beam_search._GRAPH_CACHE.
_M_STEP_GRAPHS: dict[tuple, tuple] = {}


def _run_quadratic_adam(centroids, curvature, pull, scale, steps, lr):
    if not centroids.is_cuda:
        return quadratic_adam_steps(centroids, curvature, pull, scale, steps, lr)
    key = (tuple(centroids.shape), steps, lr, centroids.dtype, centroids.device)
    if key not in _M_STEP_GRAPHS:
        static = [centroids.clone(), curvature.clone(), pull.clone()]
        # the scale enters through the pull and curvature buffers (scaled as they are copied in)
        graph, out = capture_graph(
            lambda: quadratic_adam_steps(*static, 1.0, steps, lr), lambda: quadratic_adam_steps(*static, 1.0, 1, lr)
        )
        _M_STEP_GRAPHS[key] = (graph, static, out)
    graph, static, out = _M_STEP_GRAPHS[key]
    static[0].copy_(centroids)
    static[1].copy_(curvature * scale)
    static[2].copy_(pull * scale)
    graph.replay()
    return out.clone()


def oaem_m_step(
    groups: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, metrics: torch.Tensor, steps: int, lr: float
) -> torch.Tensor:
    """S Adam steps on the centroids with assignments fixed. -> centroids [K, g]

    The objective is quadratic in each centroid, so its gradient needs only per-cluster sums:
        d/dc_k = (2/N) (A_k c_k - b_k),  A_k = sum_{i in k} H_i [K, g, g],  b_k = sum_{i in k} H_i w_i [K, g],
    gathered once per M-step; each Adam step then costs O(K g²) instead of a pass over all groups.
    """
    num_rows, num_groups, group_size = groups.shape
    num_centroids = centroids.shape[0]
    column = torch.arange(num_groups, device=codes.device).expand_as(codes)
    counts = torch.bincount((codes * num_groups + column).flatten(), minlength=num_centroids * num_groups)
    curvature = torch.einsum("kj,jgh->kgh", counts.view(num_centroids, num_groups).to(groups.dtype), metrics)  # A [K, g, g]
    weighted = torch.einsum("rjg,jgh->rjh", groups, metrics).reshape(-1, group_size)  # H_i w_i [N, g]
    pull = torch.zeros_like(centroids).index_add_(0, codes.flatten(), weighted)  # b [K, g]
    return _run_quadratic_adam(centroids, curvature, pull, 2.0 / codes.numel(), steps, lr)


def oaem_refine(
    groups: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, metrics: torch.Tensor, rounds: int, steps: int, lr: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """R rounds of (M-step, E-step). Empty clusters after an E-step are reseeded with the groups of
    largest Hessian-weighted error.

    groups [rows, G, g], centroids [K, g], codes [rows, G], metrics [G, g, g] -> centroids [K, g], codes [rows, G]
    """
    for _ in range(rounds):
        centroids = oaem_m_step(groups, centroids, codes, metrics, steps, lr)
        codes, dist = nearest_mahalanobis(groups, centroids, metrics)
        flat_centroids, flat_codes, _ = reseed_empty_clusters(
            groups.reshape(-1, groups.shape[-1]), centroids, codes.flatten(), dist.flatten()
        )
        centroids, codes = flat_centroids, flat_codes.reshape(codes.shape)
    return centroids, codes


def residual_init(
    groups: torch.Tensor,
    settings: InitSettings,
    generator: torch.Generator,
    refine: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit codebook m to the residual left by codebooks < m; optionally refine each one.

    groups [rows, G, g] -> codes [rows, G, M] int64, codebooks [M, K, g]
    """
    residual = groups.clone()
    flat_shape = (-1, groups.shape[-1])
    all_codes, all_codebooks = [], []
    for _ in range(settings.num_codebooks):
        centroids, codes = fit_kmeans(
            residual.reshape(flat_shape), 1 << settings.nbits, settings.kmeans_max_iter, generator, tolerance=settings.kmeans_tolerance
        )
        codes = codes.reshape(groups.shape[:-1])
        if refine is not None:
            centroids, codes = refine(residual, centroids, codes)
        residual = residual - centroids[codes]
        all_codes.append(codes)
        all_codebooks.append(centroids)
    return torch.stack(all_codes, dim=-1), torch.stack(all_codebooks)


def greedy_init(groups: torch.Tensor, metrics: torch.Tensor, settings: InitSettings, generator: torch.Generator):
    """Residual k-means (AQLM's initialisation). `metrics` is unused. -> codes [rows, G, M], codebooks [M, K, g]"""
    return residual_init(groups, settings, generator)


def oaem_init(groups: torch.Tensor, metrics: torch.Tensor, settings: InitSettings, generator: torch.Generator):
    """Residual k-means with each codebook refined by OA-EM. metrics: damped blocks [G, g, g]."""

    def refine(residual, centroids, codes):
        return oaem_refine(residual, centroids, codes, metrics, settings.oaem_rounds, settings.oaem_steps, settings.oaem_lr)

    return residual_init(groups, settings, generator, refine)


# "oaem-patient" starts as OA-EM does; what differs is the stop rule of the loop after it
# (aqflow.quant.quantize.INIT_STOP_PATIENCE).
INITIALISERS = {"greedy": greedy_init, "oaem": oaem_init, "oaem-patient": oaem_init}
