"""Beam search: exhaustive optimality where enumeration is possible, and never a worse objective."""

import itertools

import pytest
import torch

from aqflow.quant.beam_kernels import advance_block_columns, follow_back_pointers
from aqflow.quant.beam_search import BeamSearcher, beam_search_rows
from aqflow.quant.objective import output_error
from aqflow.quant.representation import dequantize_weight
from tests.conftest import anisotropic_xtx

G = 8  # group size


def problem(out_features, num_groups, num_codebooks, nbits, generator, block_diagonal=False):
    in_features = num_groups * G
    k = 1 << nbits
    xtx = anisotropic_xtx(in_features, 4 * in_features, generator)
    if block_diagonal:
        mask = torch.block_diag(*[torch.ones(G, G, dtype=torch.float64)] * num_groups)
        xtx = xtx * mask
    weight = torch.randn(out_features, in_features, generator=generator, dtype=torch.float64)
    codebooks = 0.5 * torch.randn(num_codebooks, k, G, generator=generator, dtype=torch.float64)
    scales = torch.rand(out_features, generator=generator, dtype=torch.float64) + 0.5
    codes = torch.randint(0, k, (out_features, num_groups, num_codebooks), generator=generator)
    return weight, xtx, codebooks, scales, codes


def row_errors(weight, xtx, codebooks, scales, codes):
    """Per-row objective. -> [out]"""
    delta = weight - dequantize_weight(codes, codebooks, scales)
    return ((delta @ xtx) * delta).sum(-1)


def all_tuples(num_codebooks, k):
    return torch.tensor(list(itertools.product(range(k), repeat=num_codebooks)))  # [K^M, M]


def exhaustive_row_optimum(weight, xtx, codebooks, scales, num_groups, k):
    """min over every code assignment of every group of every row. -> [out] objective."""
    tuples = all_tuples(codebooks.shape[0], k)
    best = torch.full((weight.shape[0],), float("inf"), dtype=weight.dtype)
    for assignment in itertools.product(range(len(tuples)), repeat=num_groups):
        codes = tuples[list(assignment)][None].expand(weight.shape[0], -1, -1)
        best = torch.minimum(best, row_errors(weight, xtx, codebooks, scales, codes))
    return best


@pytest.mark.parametrize("num_codebooks,nbits", [(2, 2), (3, 1), (1, 3)])
def test_single_group_reaches_exhaustive_optimum(num_codebooks, nbits, rng):
    """One group per row: a beam of K^(M-1) keeps every partial tuple, so the pass is exact."""
    k = 1 << nbits
    weight, xtx, codebooks, scales, codes = problem(16, 1, num_codebooks, nbits, rng)
    found = beam_search_rows(weight, xtx, codebooks, scales, codes, beam_size=k ** (num_codebooks - 1))
    optimum = exhaustive_row_optimum(weight, xtx, codebooks, scales, 1, k)
    torch.testing.assert_close(row_errors(weight, xtx, codebooks, scales, found), optimum, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_groups", [1, 2, 32], ids=lambda n: f"blocks{n}")
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("num_groups,num_codebooks,nbits", [(2, 2, 1), (3, 2, 1), (2, 2, 2), (2, 3, 1)])
def test_full_beam_over_coupled_groups_reaches_exhaustive_optimum(num_groups, num_codebooks, nbits, use_triton, block_groups, rng):
    """Full XᵀX couples the groups of a row. A beam of K^(M·G-1) holds every partial assignment, so
    one pass must find the exhaustive optimum over all (K^M)^G assignments of each row, whether the
    later groups' residuals are updated after every group (block 1), across blocks, or inside one."""
    k = 1 << nbits
    weight, xtx, codebooks, scales, codes = problem(8, num_groups, num_codebooks, nbits, rng)
    assert xtx[:G, G:].abs().sum() > 0  # really coupled
    beam = k ** (num_codebooks * num_groups - 1)
    found = beam_search_rows(weight, xtx, codebooks, scales, codes, beam_size=beam, use_triton=use_triton, block_groups=block_groups)
    optimum = exhaustive_row_optimum(weight, xtx, codebooks, scales, num_groups, k)
    torch.testing.assert_close(row_errors(weight, xtx, codebooks, scales, found), optimum, rtol=1e-10, atol=1e-10)


def test_greedy_commitment_across_groups_is_beaten_by_the_row_beam(rng):
    """Errors in one group can be compensated by later ones: on coupled problems a wide row-level beam
    (exhaustive here) finds strictly better rows than committing group by group (beam 1) on some rows."""
    weight, xtx, codebooks, scales, codes = problem(64, 3, 2, 2, rng)
    narrow = row_errors(weight, xtx, codebooks, scales, beam_search_rows(weight, xtx, codebooks, scales, codes, 1))
    wide = row_errors(weight, xtx, codebooks, scales, beam_search_rows(weight, xtx, codebooks, scales, codes, 4**5))
    assert (wide <= narrow + 1e-9).all()
    assert (wide < narrow - 1e-9).any()


@pytest.mark.parametrize("num_codebooks,nbits,beam", [(2, 4, 1), (2, 4, 3), (3, 3, 8), (1, 5, 2), (2, 6, 16)])
def test_pass_never_increases_objective(num_codebooks, nbits, beam, rng):
    for _ in range(3):
        weight, xtx, codebooks, scales, codes = problem(12, 5, num_codebooks, nbits, rng)
        before = row_errors(weight, xtx, codebooks, scales, codes)
        found = beam_search_rows(weight, xtx, codebooks, scales, codes, beam)
        after = row_errors(weight, xtx, codebooks, scales, found)
        assert (after <= before * (1 + 1e-12) + 1e-12).all()
        assert after.sum() < before.sum()  # from random codes there is always something to gain
        assert found.min() >= 0 and found.max() < (1 << nbits)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_deferred_block_updates_search_like_per_group_updates(use_triton, rng):
    """Blocks of deferred residual updates (any size, a ragged last block included) change only the
    order of floating-point sums: in float64 the codes equal those of updating after every group."""
    weight, xtx, codebooks, scales, codes = problem(16, 11, 2, 4, rng)
    per_group = beam_search_rows(weight, xtx, codebooks, scales, codes, 4, use_triton=use_triton, block_groups=1)
    assert not torch.equal(per_group, codes)
    for block_groups in (2, 4, 11, 32):
        blocked = beam_search_rows(weight, xtx, codebooks, scales, codes, 4, use_triton=use_triton, block_groups=block_groups)
        assert torch.equal(blocked, per_group), block_groups


def test_wider_beam_is_no_worse_on_average(rng):
    weight, xtx, codebooks, scales, codes = problem(64, 6, 2, 4, rng)
    narrow = output_error(weight - dequantize_weight(beam_search_rows(weight, xtx, codebooks, scales, codes, 1), codebooks, scales), xtx)
    wide = output_error(weight - dequantize_weight(beam_search_rows(weight, xtx, codebooks, scales, codes, 16), codebooks, scales), xtx)
    assert wide <= narrow


def test_chunked_rows_give_the_same_codes(rng):
    weight, xtx, codebooks, scales, codes = problem(30, 4, 2, 3, rng)
    whole = BeamSearcher(xtx, 4, memory_budget_bytes=1 << 30)(weight, codebooks, scales, codes)
    tiny_budget = BeamSearcher(xtx, 4, memory_budget_bytes=1)  # one row per chunk
    assert torch.equal(tiny_budget(weight, codebooks, scales, codes), whole)


@pytest.mark.parametrize("num_codebooks,nbits,beam", [(2, 4, 1), (2, 4, 3), (3, 3, 8), (1, 5, 2), (2, 8, 8)])
def test_triton_stage_searches_exactly_like_the_torch_stage(num_codebooks, nbits, beam, rng):
    """The one-kernel stage (Triton, interpreted on the CPU here) must pick the same codes."""
    for dtype in (torch.float64, torch.float32):
        weight, xtx, codebooks, scales, codes = (t.to(dtype) if t.is_floating_point() else t for t in problem(6, 3, num_codebooks, nbits, rng))
        torch_codes = beam_search_rows(weight, xtx, codebooks, scales, codes, beam, use_triton=False)
        triton_codes = beam_search_rows(weight, xtx, codebooks, scales, codes, beam, use_triton=True)
        assert torch.equal(torch_codes, triton_codes)


def test_shuffled_order_is_a_consistent_permutation(rng):
    """A pass in a random group/codebook order is the natural-order pass on permuted inputs, permuted
    back: it never raises the objective, and with a full beam on one group it is still exact."""
    weight, xtx, codebooks, scales, codes = problem(10, 4, 3, 2, rng)
    searcher = BeamSearcher(xtx, 4, memory_budget_bytes=1 << 30)
    before = row_errors(weight, xtx, codebooks, scales, codes)
    shuffled = searcher(weight, codebooks, scales, codes, order_seed=5)
    assert (row_errors(weight, xtx, codebooks, scales, shuffled) <= before * (1 + 1e-12) + 1e-12).all()
    assert not torch.equal(shuffled, searcher(weight, codebooks, scales, codes))  # another order, another search
    weight, xtx, codebooks, scales, codes = problem(8, 1, 2, 2, rng)
    found = BeamSearcher(xtx, 4, memory_budget_bytes=1 << 30)(weight, codebooks, scales, codes, order_seed=3)
    optimum = exhaustive_row_optimum(weight, xtx, codebooks, scales, 1, 4)
    torch.testing.assert_close(row_errors(weight, xtx, codebooks, scales, found), optimum, rtol=1e-10, atol=1e-10)


def test_back_pointer_kernel_walks_like_per_step_gathers(rng):
    """The one-kernel walk (Triton, interpreted) reads the same codes and ends at the same slots as
    two gathers per step, for several lineages per row."""
    steps, rows, beam, num_codebooks, starts = 5, 3, 4, 3, 2
    back_codes = torch.randint(0, 16, (steps, rows, beam, num_codebooks), generator=rng)
    back_origin = torch.randint(0, beam, (steps, rows, beam), generator=rng)
    start = torch.randint(0, beam, (rows, starts), generator=rng)
    codes, first_slot = follow_back_pointers(back_codes, back_origin, start)
    slot = start
    for t in reversed(range(steps)):
        assert torch.equal(codes[:, :, t], back_codes[t].gather(1, slot[..., None].expand(rows, starts, num_codebooks))), t
        slot = back_origin[t].gather(1, slot)
    assert torch.equal(first_slot, slot)


@pytest.mark.parametrize("start_col", [0, 8, 16])
def test_block_columns_kernel_updates_like_gather_and_product(start_col, rng):
    """Columns from start_col on equal each survivor's group-start row minus its change times the
    group's XᵀX rows (the torch path's gather + addmm); a ragged last tile included."""
    rows, beam, width = 3, 4, 40
    p_block = torch.randn(rows, beam, width, generator=rng, dtype=torch.float64)
    origin = torch.randint(0, beam, (rows, beam), generator=rng)
    sums = torch.randn(rows, beam, G, generator=rng, dtype=torch.float64)
    current = torch.randn(rows, G, generator=rng, dtype=torch.float64)
    scales = torch.rand(rows, generator=rng, dtype=torch.float64) + 0.5
    xtx_rows = torch.randn(G, width, generator=rng, dtype=torch.float64)
    found = advance_block_columns(p_block, origin, sums, current, scales, xtx_rows, start_col)
    change = sums * scales[:, None, None] - current[:, None, :]
    expected = p_block.gather(1, origin[..., None].expand(rows, beam, width)) - change @ xtx_rows
    torch.testing.assert_close(found[..., start_col:], expected[..., start_col:], rtol=1e-12, atol=1e-12)
