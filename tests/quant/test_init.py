"""Initialisations: k-means uses every codeword, OA-EM beats residual k-means where XᵀX is anisotropic."""

import torch

from aqflow.quant.init import INITIALISERS, InitSettings, cosine_lr, oaem_m_step, oaem_objective, oaem_refine
from aqflow.quant.kmeans import fit_kmeans, nearest_euclidean, nearest_mahalanobis
from aqflow.quant.objective import damped_diagonal_blocks, relative_output_mse
from aqflow.quant.representation import dequantize_weight
from tests.conftest import anisotropic_xtx


def test_kmeans_uses_every_codeword_even_with_duplicate_points(rng):
    # 3 well-separated blobs, many exact duplicates, K=8: random starts collide, clusters empty out.
    blobs = torch.tensor([[0.0] * 4, [5.0] * 4, [-5.0] * 4])
    points = torch.cat([blobs.repeat_interleave(50, 0), blobs + 0.1 * torch.randn(3, 4, generator=rng)])
    points = torch.cat([points, torch.randn(20, 4, generator=rng)])
    centroids, codes = fit_kmeans(points, 8, 100, rng)
    assert torch.bincount(codes, minlength=8).min() > 0
    assert torch.isfinite(centroids).all()


def test_kmeans_lowers_distortion_against_its_start(rng):
    points = torch.randn(500, 8, generator=rng)
    centroids0, codes0 = fit_kmeans(points, 16, 0, torch.Generator().manual_seed(3))
    centroids, codes = fit_kmeans(points, 16, 100, torch.Generator().manual_seed(3))
    d0 = ((points - centroids0[codes0]) ** 2).sum()
    d = ((points - centroids[codes]) ** 2).sum()
    assert d < d0


def test_mahalanobis_assignment_is_the_brute_force_argmin(rng):
    groups = torch.randn(5, 3, 8, generator=rng, dtype=torch.float64)
    centroids = torch.randn(6, 8, generator=rng, dtype=torch.float64)
    a = torch.randn(3, 8, 8, generator=rng, dtype=torch.float64)
    metrics = a @ a.transpose(1, 2) + torch.eye(8, dtype=torch.float64)
    codes, dist = nearest_mahalanobis(groups, centroids, metrics)
    diff = groups[:, :, None, :] - centroids[None, None]  # [5, 3, 6, 8]
    brute = torch.einsum("rjkg,jgh,rjkh->rjk", diff, metrics, diff)
    assert torch.equal(codes, brute.argmin(-1))
    torch.testing.assert_close(dist, brute.min(-1).values)


def _layer(rng, out_features=96, in_features=64):
    xtx = anisotropic_xtx(in_features, 2048, rng, spread=100.0).float()
    weight = torch.randn(out_features, in_features, generator=rng)
    scales = weight.norm(dim=1)
    groups = (weight / scales[:, None]).reshape(out_features, in_features // 8, 8)
    return weight, xtx, scales, groups


def test_oaem_m_step_lowers_its_objective(rng):
    _, xtx, _, groups = _layer(rng)
    metrics = damped_diagonal_blocks(xtx, 8, 0.01)
    centroids, codes = fit_kmeans(groups.reshape(-1, 8), 16, 50, rng)
    codes = codes.reshape(groups.shape[:2])
    before = oaem_objective(groups, centroids, codes, metrics)
    after = oaem_objective(groups, oaem_m_step(groups, centroids, codes, metrics, 100, 1e-3), codes, metrics)
    assert after < before


def test_oaem_refine_keeps_every_codeword_in_use(rng):
    _, xtx, _, groups = _layer(rng)
    metrics = damped_diagonal_blocks(xtx, 8, 0.01)
    centroids, codes = fit_kmeans(groups.reshape(-1, 8), 64, 50, rng)
    centroids, codes = oaem_refine(groups, centroids, codes.reshape(groups.shape[:2]), metrics, 3, 50, 1e-2)
    assert torch.bincount(codes.flatten(), minlength=64).min() > 0


def test_oaem_beats_residual_kmeans_on_anisotropic_xtx(rng):
    """The paper's claim at init: with strongly non-isotropic XᵀX, Hessian-weighted placement gives a
    lower output error (both the block-diagonal objective OA-EM targets and the full one)."""
    weight, xtx, scales, groups = _layer(rng, out_features=128, in_features=64)
    metrics = damped_diagonal_blocks(xtx, 8, 0.01)
    settings = InitSettings(num_codebooks=2, nbits=5, kmeans_max_iter=100, oaem_rounds=3, oaem_steps=100)  # the paper's defaults
    results = {}
    for name in ("greedy", "oaem"):
        codes, codebooks = INITIALISERS[name](groups, metrics, settings, torch.Generator().manual_seed(0))
        weight_hat = dequantize_weight(codes, codebooks, scales)
        error = (groups - (weight_hat / scales[:, None]).reshape(groups.shape))
        results[name] = (
            float(torch.einsum("rjg,jgh,rjh->", error, metrics, error)),
            float(relative_output_mse(weight, weight_hat, xtx)),
        )
    assert results["oaem"][0] < 0.9 * results["greedy"][0], results
    assert results["oaem"][1] < results["greedy"][1], results


def test_m_step_equals_torch_adam_on_the_objective(rng):
    """The M-step's sufficient-statistics gradient and its Adam (cosine lr) equal torch's Adam on
    autograd of eq. 3, step for step."""
    _, xtx, _, groups = _layer(rng)
    groups = groups.double()
    metrics = damped_diagonal_blocks(xtx.double(), 8, 0.01)
    centroids, codes = fit_kmeans(groups.reshape(-1, 8), 16, 20, rng)
    codes = codes.reshape(groups.shape[:2])
    c = centroids.clone().requires_grad_(True)
    reference = torch.optim.Adam([c], lr=1e-3)
    for step in range(5):
        reference.param_groups[0]["lr"] = cosine_lr(step, 5, 1e-3)
        reference.zero_grad()
        oaem_objective(groups, c, codes, metrics).backward()
        reference.step()
    ours = oaem_m_step(groups, centroids, codes, metrics, steps=5, lr=1e-3)
    torch.testing.assert_close(ours, c.detach())


def test_fused_nearest_kernel_matches_torch(rng):
    """The Triton assignment kernel (interpreted on the CPU here) gives the torch argmin."""
    points = torch.randn(300, 8, generator=rng)
    centroids = torch.randn(64, 8, generator=rng)
    codes, dist = nearest_euclidean(points, centroids, fused=False)
    fused_codes, fused_dist = nearest_euclidean(points, centroids, fused=True)
    assert torch.equal(codes, fused_codes)
    torch.testing.assert_close(dist, fused_dist, rtol=1e-4, atol=1e-4)
    groups = torch.randn(10, 4, 8, generator=rng)
    a = torch.randn(4, 8, 8, generator=rng)
    metrics = a @ a.transpose(1, 2) + torch.eye(8)
    codes, dist = nearest_mahalanobis(groups, centroids, metrics, fused=False)
    fused_codes, fused_dist = nearest_mahalanobis(groups, centroids, metrics, fused=True)
    assert torch.equal(codes, fused_codes)
    torch.testing.assert_close(dist, fused_dist, rtol=1e-4, atol=1e-3)


def test_kmeans_tolerance_stops_when_progress_stalls(rng):
    """A tolerance no check can meet (1.0) stops at the first check: the result of 10 iterations.
    A tiny one stops only where the distortion has all but stalled: the same result as none."""
    points = torch.randn(2000, 8, generator=rng)
    ten, ten_codes = fit_kmeans(points, 16, 10, torch.Generator().manual_seed(3))
    early, early_codes = fit_kmeans(points, 16, 500, torch.Generator().manual_seed(3), tolerance=1.0)
    assert torch.equal(early_codes, ten_codes) and torch.equal(early, ten)
    full, full_codes = fit_kmeans(points, 16, 500, torch.Generator().manual_seed(3))
    assert not torch.equal(full_codes, ten_codes)  # there was more to gain after 10 iterations
    tiny, tiny_codes = fit_kmeans(points, 16, 500, torch.Generator().manual_seed(3), tolerance=1e-12)
    assert torch.equal(tiny_codes, full_codes)
