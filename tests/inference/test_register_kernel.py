"""The compiled table kernels (avx512, avx2, neon: each one this machine runs, forced in turn): exact
products, their layout, their table kinds, and the AVX-512 kernel's own table layouts."""

import numpy as np
import pytest
import torch

from aqflow.inference import cpu_dispatch, register_kernel
from aqflow.inference.cpu_kernels import lut_matmul
from aqflow.inference.fast_linear import FastQuantizedLinear
from aqflow.inference.layout import QuantizedWeights, dense_weight
from tests.inference.cpu_kernel_cases import CPU_KERNELS, forced_cpu_kernel

needs_avx512 = pytest.mark.skipif("avx512" not in CPU_KERNELS, reason="the avx512 kernel does not run or build here")


@pytest.fixture
def avx512(monkeypatch):
    """The AVX-512 kernel, forced for the test (its own table layouts and kinds are tested here)."""
    with forced_cpu_kernel(monkeypatch, "avx512") as name:
        yield name


def random_layer(out_features: int = 192, in_features: int = 96, seed: int = 0) -> QuantizedWeights:
    generator = torch.Generator().manual_seed(seed)
    return QuantizedWeights(
        codes=torch.randint(0, 256, (out_features, in_features // 8, 2), dtype=torch.uint8, generator=generator),
        codebooks=torch.randn(2, 256, 8, generator=generator), scales=torch.rand(out_features, generator=generator) + 0.5,
        bias=torch.randn(out_features, generator=generator), nbits=8)


def test_column_tiles_hold_every_code_once():
    codes = random_layer().codes
    tiles = register_kernel.column_tiles(codes)
    assert tiles.shape == (3, 24, 64)
    assert tiles[1, 5, 7] == codes[64 + 7, 2, 1]  # column 5 = group 2, codebook 1
    assert torch.equal(register_kernel.rows_from_column_tiles(tiles, 2), codes)


def test_block_tiles_hold_every_code_once_block_after_block():
    """block_tiles (the avx2 and neon kernels' layout): code (tile a, column c, row r) of block b = c // 16,
    of width w (16, the last 8 here), at byte 16 b * tiles * 64 + a * w * 64 + (c - 16 b) * 64 + r."""
    codes = random_layer(out_features=192, in_features=160).codes  # 3 tiles, 40 columns: blocks of 16, 16, 8
    held = register_kernel.block_tiles(codes)
    assert held.shape == (3, 40, 64) and held.is_contiguous()
    flat = held.reshape(-1)
    for a, c, r in ((0, 0, 0), (1, 5, 7), (2, 17, 63), (2, 39, 1), (1, 33, 20)):
        b = c // 16
        width = min(16, 40 - 16 * b)
        assert flat[16 * b * 3 * 64 + a * width * 64 + (c - 16 * b) * 64 + r] == codes[64 * a + r].reshape(-1)[c]
    assert torch.equal(register_kernel.rows_from_block_tiles(held, 2), codes)
    for layout in register_kernel.LAYOUTS:
        assert torch.equal(register_kernel.rows_from_kernel_tiles(register_kernel.kernel_tiles(codes, layout), 2,
                                                                  layout), codes)


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_compiled_product_is_the_layer_within_float32_rounding(compiled_cpu_kernel, tokens):
    # 9 tiles of rows: a whole group of 8 sharing each column's table, and one left over; 128 code
    # columns: one slice, two, and three unequal ones summed apart and added
    w = random_layer(out_features=9 * 64, in_features=512)
    x = torch.randn(tokens, w.in_features, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ dense_weight(w).double().T + w.bias.double()
    assert [register_kernel.column_blocks(128, threads) for threads in (1, 2, 3)] == [1, 2, 3]
    for threads in (1, 2, 3):
        got = register_kernel.register_product(x, register_kernel.kernel_tiles(w.codes), w.codebooks, w.scales,
                                               w.bias, threads)
        assert got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert (got - lut_matmul(x, w)).abs().max() <= 1e-5 * exact.abs().max()


def test_16_bit_activations_take_the_kernels_tables_within_the_float16_bound(compiled_cpu_kernel, monkeypatch):
    """bfloat16 activations through each float table kind of the kernel (avx512: float16 and float32;
    avx2, neon: float32): each output within 2^-11 of the sum of its entries' magnitudes of the exact
    product (float16 tables round each entry by at most that), and closer to it than the dense bfloat16
    layer. float32 tables give the float32 activations' outputs bit for bit; float16 ones differ from them."""
    w = random_layer(out_features=9 * 64, in_features=512)
    x = torch.randn(1, w.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert register_kernel.table_dtype_for(torch.bfloat16) == "float16"  # 16-bit activations may take float16
    assert register_kernel.table_dtype_for(torch.float32) == "float32"
    xs = x.double().reshape(-1, 8)  # [G, g]
    tables = torch.einsum("jd,mkd->jmk", xs, w.codebooks.double())  # [G, M, K]
    groups = torch.arange(w.codes.shape[1])[None, :, None]
    books = torch.arange(2)[None, None, :]
    entries = tables[groups, books, w.codes.long()]  # [out, G, M]
    exact = entries.sum(dim=(1, 2)) * w.scales.double() + w.bias.double()
    bound = 2.0 ** -11 * entries.abs().sum(dim=(1, 2)) * w.scales.double() + 1e-5 * exact.abs().max()
    tiles = register_kernel.kernel_tiles(w.codes)
    # closer to the exact product than the dense bfloat16 layer it stands for (~10x on this layer)
    dense = torch.nn.functional.linear(x, dense_weight(w).to(torch.bfloat16), w.bias.to(torch.bfloat16))[0].double()
    kinds = [kind for kind in register_kernel.compiled_kernel().kinds() if kind in ("float16", "float32")]
    assert "float32" in kinds
    for kind in kinds:
        monkeypatch.setenv(register_kernel.TABLES_ENV, kind)
        for threads in (1, 3):
            half = register_kernel.register_product(x, tiles, w.codebooks, w.scales, w.bias, threads)[0].double()
            assert ((half - exact).abs() <= bound).all()
            assert (half - exact).abs().max() <= (dense - exact).abs().max() / 4
            single = register_kernel.register_product(x.float(), tiles, w.codebooks, w.scales, w.bias, threads)[0].double()
            assert (single - exact).abs().max() <= 1e-5 * exact.abs().max()
            assert torch.equal(half, single) == (kind == "float32")


@needs_avx512
def test_16_bit_activations_take_the_tables_timed_faster_or_the_ones_asked_for(avx512, monkeypatch):
    """AQFLOW_CPU_TABLES=auto: the first product at a thread count times every kind this CPU has (float16,
    float32, and int16 with AVX-512 VBMI and VNNI) and keeps the fastest for every later one (the outputs
    are that kind's); a kind's name forces it; anything else is an error naming the variable. float32
    activations never consult it."""
    w = random_layer(out_features=9 * 64, in_features=512)
    x = torch.randn(1, w.in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    operands = register_kernel.register_operands(register_kernel.kernel_tiles(w.codes), w.codebooks, w.scales, w.bias,
                                                 register_kernel.kernel_layout())
    flat = x.float().numpy()
    kinds = register_kernel.compiled_kernel().kinds()
    by_kind = {kind: torch.from_numpy(register_kernel.register_matmul(flat, operands, 2, kind)) for kind in kinds}
    assert not torch.equal(by_kind["float16"], by_kind["float32"])
    monkeypatch.setattr(register_kernel, "_fastest_tables", {})
    monkeypatch.setenv(register_kernel.TABLES_ENV, "auto")
    first = register_kernel.product_with_operands(x, operands, threads=2)
    chosen = register_kernel.chosen_tables()[2]
    assert torch.equal(first, by_kind[chosen])
    register_kernel._fastest_tables["avx512", 2] = "float32" if chosen == "float16" else "float16"  # kept, not re-timed
    assert torch.equal(register_kernel.product_with_operands(x, operands, threads=2),
                       by_kind[register_kernel.chosen_tables()[2]])
    for kind in kinds:
        monkeypatch.setenv(register_kernel.TABLES_ENV, kind)
        assert torch.equal(register_kernel.product_with_operands(x, operands, threads=2), by_kind[kind])
    monkeypatch.setenv(register_kernel.TABLES_ENV, "float8")
    with pytest.raises(ValueError, match="AQFLOW_CPU_TABLES"):
        register_kernel.product_with_operands(x, operands, threads=2)
    register_kernel.product_with_operands(x.float(), operands, threads=2)  # float32 tables, no question asked


def test_a_fast_linear_holds_its_kernels_layout_and_gives_the_gather_kernels_outputs(compiled_cpu_kernel, monkeypatch):
    """A layer made under a compiled kernel holds the codes as that kernel reads them (avx512: column
    tiles, avx2 and neon: block-major), gives the numba kernels' outputs, and is refused by a kernel of
    another layout rather than read wrongly."""
    w = random_layer(out_features=192, in_features=160)  # 40 code columns: blocks of 16, 16 and 8
    fast = FastQuantizedLinear(w)
    assert fast.layout == {"avx512": "columns"}.get(compiled_cpu_kernel, "blocks")
    assert torch.equal(fast.weights.codes, w.codes)
    # codes held in int32 (a container of wider codebooks) are not bytes: the gather kernels read them
    wide = QuantizedWeights(codes=w.codes.to(torch.int32), codebooks=w.codebooks, scales=w.scales, bias=w.bias, nbits=8)
    assert FastQuantizedLinear(wide).layout == "tiles"
    # decode, a short prompt, and the dequantized path beyond LUT_MAX_TOKENS
    inputs = [torch.randn(tokens, w.in_features, generator=torch.Generator().manual_seed(tokens)) for tokens in (1, 4, 16)]
    outputs = [fast(x) for x in inputs]
    with forced_cpu_kernel(monkeypatch, "numba"):
        gathers = FastQuantizedLinear(w)
        assert gathers.layout == "tiles"
        for x, got in zip(inputs, outputs):
            expected = gathers(x)
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    for other in CPU_KERNELS:
        if other != "numba":
            with forced_cpu_kernel(monkeypatch, other):
                if register_kernel.kernel_layout() != fast.layout:
                    with pytest.raises(RuntimeError, match="lay them out again"):
                        fast(inputs[0])


@needs_avx512
def test_the_code_prefetch_distance_changes_the_build_not_the_sums(avx512, monkeypatch, tmp_path):
    """AQFLOW_CPU_PREFETCH builds the kernel with another distance (its own cached library); the sums are
    the same bits with none, with the default and with a distance past a slice (the next group's columns)."""
    w = random_layer(out_features=11 * 64, in_features=256)  # a group of 8 tiles and 3 more: two groups
    x = torch.randn(1, w.in_features, generator=torch.Generator().manual_seed(3))
    tiles = register_kernel.kernel_tiles(w.codes)
    monkeypatch.setenv("AQFLOW_KERNEL_CACHE", str(tmp_path))
    outputs = []
    try:
        for columns in ("0", "8", "50"):
            monkeypatch.setenv(cpu_dispatch.PREFETCH_ENV, columns)
            register_kernel.compiled_kernel.cache_clear()
            assert cpu_dispatch.prefetch_columns() == int(columns)
            outputs.append(register_kernel.register_product(x, tiles, w.codebooks, w.scales, w.bias, 3))
        assert len(list(tmp_path.glob("lut_cpu-avx512-*.so"))) == 3
        assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
        for bad in ("-1", "eight"):
            monkeypatch.setenv(cpu_dispatch.PREFETCH_ENV, bad)
            with pytest.raises(ValueError, match=cpu_dispatch.PREFETCH_ENV):
                cpu_dispatch.prefetch_columns()
    finally:
        monkeypatch.delenv(cpu_dispatch.PREFETCH_ENV)
        register_kernel.compiled_kernel.cache_clear()


@needs_avx512
@pytest.mark.skipif(not all(flag in cpu_dispatch.cpu_flags() for flag in register_kernel.INT16_CPU_FLAGS),
                    reason="no AVX-512 VBMI and VNNI here")
@pytest.mark.parametrize("tokens", [1, 2])
def test_int16_tables_keep_each_entry_within_half_its_blocks_step(avx512, monkeypatch, tokens):
    """int16 tables: each block of 8 code columns of a slice shares a step, its largest |entry| / 32767,
    and each entry is the nearest multiple of it, so each output is within half a step per code (times the
    row's scale) of the exact product: checked with one slice (blocks from column 0) and with three
    (blocks from each slice's first column), over 11 tiles (a group of 8 and 3 more, each put back in row
    order) and a last block of 4 columns. Far closer to the exact product than the float16 tables."""
    monkeypatch.setenv(register_kernel.TABLES_ENV, "int16")
    w = random_layer(out_features=11 * 64, in_features=464)  # 116 columns: 14 whole blocks and one of 4
    x = torch.randn(tokens, w.in_features, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    xs = x.double().reshape(tokens, -1, 8)  # [T, G, g]
    tables = torch.einsum("tjd,mkd->tjmk", xs, w.codebooks.double()).reshape(tokens, -1, 256)  # [T, C, K]
    columns = tables.shape[1]
    flat_codes = w.codes.reshape(w.out_features, -1).long()  # [out, C]
    entries = tables[:, torch.arange(columns)[None, :], flat_codes]  # [T, out, C]
    exact = entries.sum(-1) * w.scales.double() + w.bias.double()
    tiles = register_kernel.kernel_tiles(w.codes)
    for threads in (1, 3):
        blocks = register_kernel.column_blocks(columns, threads)
        steps = torch.empty(tokens, columns, dtype=torch.float64)
        for block in range(blocks):
            first, last = block * columns // blocks, (block + 1) * columns // blocks
            for start in range(first, last, 8):
                stop = min(start + 8, last)
                steps[:, start:stop] = tables[:, start:stop].abs().amax(dim=(1, 2), keepdim=True)[..., 0] / 32767
        bound = 0.501 * steps.sum(-1, keepdim=True) * w.scales.double().abs() + 1e-6 * exact.abs().max()
        got = register_kernel.register_product(x, tiles, w.codebooks, w.scales, w.bias, threads).double()
        assert ((got - exact).abs() <= bound).all()
    monkeypatch.setenv(register_kernel.TABLES_ENV, "float16")
    half = register_kernel.register_product(x, tiles, w.codebooks, w.scales, w.bias, 1).double()
    assert (got - exact).abs().max() <= (half - exact).abs().max() / 4


@needs_avx512
@pytest.mark.skipif(register_kernel.PLANES_CPU_FLAG not in cpu_dispatch.cpu_flags(), reason="no AVX-512 VBMI here")
def test_float32_tables_as_byte_planes_give_the_register_tables_sums_bit_for_bit(avx512, monkeypatch):
    """Byte planes hold the same float32 entries and add them in the same order, so every sum is the same
    bits as with the tables in float32 registers: 11 tiles (a group of 8 and 3 more, each group's sums put
    back in row order), 1 and 3 slices, 1 and 2 tokens; AQFLOW_CPU_PLANES=0 keeps the registers, and
    anything but 0 or 1 is an error naming it."""
    w = random_layer(out_features=11 * 64, in_features=512)
    tiles = register_kernel.kernel_tiles(w.codes)
    x = torch.randn(2, w.in_features, generator=torch.Generator().manual_seed(5))
    by_layout = {}
    try:
        for value in ("1", "0"):
            monkeypatch.setenv(register_kernel.PLANES_ENV, value)
            register_kernel.compiled_kernel.cache_clear()
            layout = register_kernel.compiled_kernel().float32_layout
            by_layout[layout] = [register_kernel.register_product(x[:tokens], tiles, w.codebooks, w.scales, w.bias,
                                                                  threads) for tokens in (1, 2) for threads in (1, 3)]
        assert set(by_layout) == {"planes", "registers"}
        assert all(torch.equal(a, b) for a, b in zip(by_layout["planes"], by_layout["registers"]))
        exact = x.double() @ dense_weight(w).double().T + w.bias.double()
        assert (by_layout["planes"][-1].double() - exact).abs().max() <= 1e-5 * exact.abs().max()
        monkeypatch.setenv(register_kernel.PLANES_ENV, "yes")
        register_kernel.compiled_kernel.cache_clear()
        with pytest.raises(ValueError, match=register_kernel.PLANES_ENV):
            register_kernel.compiled_kernel()
    finally:
        monkeypatch.delenv(register_kernel.PLANES_ENV)
        register_kernel.compiled_kernel.cache_clear()


@pytest.mark.parametrize("tokens, dtype", [(1, torch.float32), (3, torch.bfloat16), (9, torch.float32)])
def test_fused_layers_give_each_layers_own_output_and_hold_the_codes_once(compiled_cpu_kernel, tokens, dtype,
                                                                          monkeypatch):
    """q/k/v-like layers of one input (unequal heights, their own codebooks, one with a bias) fused into
    one product: bit for bit the outputs of the layers called one by one, at 1 and 3 tokens (one
    register-kernel call) and at 9 (each layer's prefill path); the layers' codes become views of one
    stacked tensor."""
    from aqflow.inference.decode import _fused_owner
    from aqflow.inference.fast_linear import FusedColumnsLinear
    from aqflow.inference.runtime import resident_weight_bytes

    # both products with the same tables (no timing race): the kernel's first kind
    monkeypatch.setenv(register_kernel.TABLES_ENV, register_kernel.compiled_kernel().kinds()[0])
    layers = [FastQuantizedLinear(random_layer(out_features=rows, in_features=256, seed=seed))
              for seed, rows in enumerate((5 * 64, 64, 2 * 64))]
    layers[1].bias = None
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    alone = torch.cat([layer(x) for layer in layers], dim=-1)
    bytes_alone = sum(resident_weight_bytes(layer) for layer in layers)
    fused = _fused_owner(layers)
    assert isinstance(fused, FusedColumnsLinear)
    got = fused(x)
    assert got.dtype == dtype and got.shape == (tokens, 8 * 64)
    assert torch.equal(got, alone)
    assert resident_weight_bytes(fused) <= bytes_alone  # the stack replaced the layers' own codes
    assert all(layer.codes.untyped_storage().data_ptr() == fused._stacked_codes.untyped_storage().data_ptr()
               for layer in layers)
    flat = x.float().numpy()
    for threads in (1, 2):  # the calling thread alone, and the parallel loop
        stacked = register_kernel.register_matmul(flat, fused.operands(), threads)
        one_by_one = [register_kernel.register_matmul(flat, layer.register_operands(), threads) for layer in layers]
        assert (stacked == np.concatenate(one_by_one, axis=1)).all()
