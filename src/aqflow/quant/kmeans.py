"""Clustering of weight groups: Euclidean k-means and Hessian-weighted (Mahalanobis) assignment.

Points are weight groups laid out as [rows, G, g] (row-major over the layer), so that the
Mahalanobis metric H_j of column group j can be applied without materialising [N, g, g].
Empty clusters are reseeded with the worst-served points: a codeword nobody uses is wasted bits.
"""

from __future__ import annotations

import torch

from aqflow.quant.cuda_graphs import capture_graph
from aqflow.quant.nearest_kernels import nearest_fused, nearest_fused_supported

# Elements of a distance block computed at once: on the GPU a bound on memory, on the CPU a block
# that stays in cache (4.5x faster than one [N, K] matrix for SmolLM2's 110k groups x 256 codewords).
_DISTANCE_BUDGET_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 19}


def _row_chunks(num_rows: int, elements_per_row: int, device: torch.device):
    budget = _DISTANCE_BUDGET_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    step = max(1, budget // max(1, elements_per_row))
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def nearest_euclidean(
    points: torch.Tensor, centroids: torch.Tensor, fused: bool | None = None, with_distance: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Nearest centroid by squared Euclidean distance. fused: the Triton kernel (default on CUDA).

    points [N, g], centroids [K, g] -> codes [N] int64, squared distance [N] (None without with_distance)
    """
    if fused if fused is not None else nearest_fused_supported(centroids.shape[0], centroids.shape[1], points.device):
        codes, best = nearest_fused(points, (centroids * centroids).sum(-1)[None], centroids)
        if not with_distance:
            return codes, None
        return codes, (best.to(points.dtype) + (points * points).sum(-1)).clamp_min(0)
    codes = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
    best = torch.empty(points.shape[0], dtype=points.dtype, device=points.device)
    centroid_sq = (centroids * centroids).sum(-1)  # [K]
    for rows in _row_chunks(points.shape[0], centroids.shape[0], points.device):
        # |c|² - 2 x·c, one fused product; |x|² is the same for every centroid
        best[rows], codes[rows] = torch.addmm(centroid_sq, points[rows], centroids.T, alpha=-2).min(dim=-1)
    if not with_distance:
        return codes, None
    return codes, (best + (points * points).sum(-1)).clamp_min(0)


def nearest_mahalanobis(
    groups: torch.Tensor, centroids: torch.Tensor, metrics: torch.Tensor, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid under the metric of each column group (paper, eq. 4).

    (w - c)ᵀ H_j (w - c) = wᵀH_j w - 2 wᵀH_j c + cᵀH_j c, evaluated for all K at once per group.
    groups [rows, G, g], centroids [K, g], metrics H [G, g, g] -> codes [rows, G] int64, distance [rows, G]
    """
    num_rows, num_groups, _ = groups.shape
    num_centroids = centroids.shape[0]
    centroid_energy = torch.einsum("kg,jgh,kh->jk", centroids, metrics, centroids)  # [G, K]
    if fused if fused is not None else nearest_fused_supported(num_centroids, groups.shape[-1], groups.device):
        weighted = torch.einsum("rjg,jgh->rjh", groups, metrics)  # [rows, G, g]
        codes, best = nearest_fused(weighted.reshape(-1, groups.shape[-1]), centroid_energy, centroids)
        dist = best.to(groups.dtype).view(num_rows, num_groups) + (weighted * groups).sum(-1)
        return codes.view(num_rows, num_groups), dist.clamp_min(0)
    codes = torch.empty(num_rows, num_groups, dtype=torch.int64, device=groups.device)
    dist = torch.empty(num_rows, num_groups, dtype=groups.dtype, device=groups.device)
    for rows in _row_chunks(num_rows, num_groups * num_centroids, groups.device):
        weighted = torch.einsum("rjg,jgh->rjh", groups[rows], metrics)  # [n, G, g] = w H_j
        d = torch.matmul(weighted, centroids.T).mul_(-2).add_(centroid_energy)  # [n, G, K], in place
        best, codes[rows] = d.min(dim=-1)
        dist[rows] = (best + (weighted * groups[rows]).sum(-1)).clamp_min(0)
    return codes, dist


def reseed_empty_clusters(
    points: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, distances: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Move every unused centroid onto one of the worst-served points and assign that point to it.

    points [N, g], centroids [K, g], codes [N], distances [N] (each point's error to its centroid)
    -> centroids [K, g], codes [N], number of clusters reseeded
    """
    counts = torch.bincount(codes, minlength=centroids.shape[0])
    empty = torch.nonzero(counts == 0).flatten()
    if empty.numel() == 0:
        return centroids, codes, 0
    worst = torch.topk(distances, k=min(empty.numel(), points.shape[0])).indices
    empty = empty[: worst.numel()]
    centroids = centroids.clone()
    codes = codes.clone()
    centroids[empty] = points[worst]
    codes[worst] = empty
    return centroids, codes, int(empty.numel())


def cluster_means(points: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Mean of the points of each cluster; a cluster with no points keeps its centroid.
    (Counts by index_add, not bincount: bincount synchronises, which a captured graph forbids.)

    points [N, g], codes [N], centroids [K, g] -> [K, g]
    """
    sums = torch.zeros_like(centroids).index_add_(0, codes, points)
    counts = torch.zeros(centroids.shape[0], 1, dtype=points.dtype, device=points.device)
    counts.index_add_(0, codes, torch.ones_like(points[:, :1]))
    return torch.where(counts > 0, sums / counts.clamp_min(1), centroids)


def lloyd_steps(points: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` Lloyd iterations (means, then nearest), free of host synchronisation.

    points [N, g], centroids [K, g], codes [N] -> centroids [K, g], codes [N]
    """
    for _ in range(steps):
        centroids = cluster_means(points, codes, centroids)
        codes, _ = nearest_euclidean(points, centroids, with_distance=False)
    return centroids, codes


# Captured blocks of Lloyd iterations, by (N, K, g, steps, dtype, device): a k-means run is up to
# a thousand small iterations whose launch overhead would otherwise exceed their work.
_LLOYD_GRAPHS: dict[tuple, tuple] = {}


def _run_lloyd(points, centroids, codes, steps):
    if not points.is_cuda:
        return lloyd_steps(points, centroids, codes, steps)
    key = (tuple(points.shape), centroids.shape[0], steps, points.dtype, points.device)
    if key not in _LLOYD_GRAPHS:
        static = (points.clone(), centroids.clone(), codes.clone())

        def run():
            new_centroids, new_codes = lloyd_steps(*static, steps)
            static[1].copy_(new_centroids)
            static[2].copy_(new_codes)

        graph, _ = capture_graph(run, lambda: lloyd_steps(*(t.clone() for t in static), steps))
        _LLOYD_GRAPHS[key] = (graph, static)
    graph, (static_points, static_centroids, static_codes) = _LLOYD_GRAPHS[key]
    static_points.copy_(points)
    static_centroids.copy_(centroids)
    static_codes.copy_(codes)
    graph.replay()
    return static_centroids.clone(), static_codes.clone()


def fit_kmeans(
    points: torch.Tensor, num_clusters: int, max_iter: int, generator: torch.Generator, check_every: int = 10, tolerance: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means from K distinct random points until assignments settle, max_iter, or the
    distortion (sum of squared distances) fell by less than `tolerance` (relative) over the last
    `check_every` iterations. Lloyd's tail on millions of points moves a few points per iteration
    for hundreds of iterations; a codebook init does not need it (on Llama-3B-shaped layers, 200
    iterations instead of 1000 moved the quantizer's final error by 0.1-0.25 %).

    Every `check_every` iterations (checks synchronise with the device, so they are not done every
    step; on CUDA the iterations between checks replay as one graph) empty clusters are reseeded
    and convergence is tested.
    points [N, g] (N >= K) -> centroids [K, g], codes [N] int64
    """
    if points.shape[0] < num_clusters:
        raise ValueError(f"k-means needs at least K={num_clusters} points, got {points.shape[0]}")
    start = torch.randperm(points.shape[0], generator=generator, device="cpu")[:num_clusters]
    centroids = points[start.to(points.device)].clone()
    codes, dist = nearest_euclidean(points, centroids)
    distortion = float(dist.sum())
    checked = codes
    done = 0
    while done < max_iter:
        steps = min(check_every, max_iter - done)
        centroids, codes = _run_lloyd(points, centroids, codes, steps)
        done += steps
        dist = ((points - centroids[codes]) ** 2).sum(-1)
        centroids, codes, reseeded = reseed_empty_clusters(points, centroids, codes, dist)
        if reseeded == 0 and torch.equal(codes, checked):
            break
        previous, distortion = distortion, float(dist.sum())
        if reseeded == 0 and previous - distortion < tolerance * distortion:
            break
        checked = codes
    return centroids, codes
