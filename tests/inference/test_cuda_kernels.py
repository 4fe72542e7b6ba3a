"""The CUDA LUT kernel: its source compiles for Hopper without spills (where nvcc exists), its launch
configurations stay within the kernel's limits, and on a GPU it equals the dense reference (skipped
without one; benchmarks/inference_gpu.py checks it on the GPU machine too)."""

import re
import shutil
import subprocess

import pytest
import torch

from aqflow.inference import cuda_kernels, gpu_kernels as gk
from aqflow.inference.layout import QuantizedWeights


def random_2x8(out: int, groups: int, bias: bool, generator: torch.Generator, device="cpu",
               dtype=torch.float32) -> QuantizedWeights:
    return QuantizedWeights(
        codes=torch.randint(0, 256, (out, groups, 2), generator=generator).to(torch.uint8).to(device),
        codebooks=torch.randn(2, 256, 8, generator=generator).to(dtype).to(device),
        scales=(torch.rand(out, generator=generator) + 0.5).to(dtype).to(device),
        bias=torch.randn(out, generator=generator).to(dtype).to(device) if bias else None, nbits=8)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc (CI has none)")
@pytest.mark.parametrize("source", ["lut_gemv.cu", "lut_gemv_cluster.cu"])
def test_cuda_source_compiles_for_hopper_without_spills(tmp_path, source):
    """Every instantiation of each kernel assembles for sm_90a with no local-memory spills and at most
    128 registers (two CTAs of 256 threads per multiprocessor)."""
    result = subprocess.run(
        ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xptxas", "-v", "-c",
         str(cuda_kernels.SOURCE_DIR / source), "-o", str(tmp_path / "kernel.o")],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    # split-K: bf16/fp16 x fp32/fp16 entries x 1/4 tokens; cluster: bf16/fp16 x fp32/fp16 entries x 256/128 rows
    assert len(registers) == 8 and len(spills) == 8, report
    assert all(stores == "0" and loads == "0" for stores, loads in spills), report
    assert max(registers) <= 128, report


def test_candidate_configurations_fit_the_kernel():
    """Rows per CTA in whole batches of 256, groups per CTA in chunks of 16, shared memory under the limit,
    and the split each label reports is the one the kernel derives."""
    generator = torch.Generator().manual_seed(0)
    for outs, groups in (([3072, 1024, 1024], 384), ([8192, 8192], 384), ([3072], 1024), ([576], 72)):
        packed = gk.pack_weights([random_2x8(o, groups, False, generator) for o in outs])
        for tokens in (1, 3):
            configs = cuda_kernels.candidate_configs(packed, tokens, multiprocessors=132)
            assert configs and len(set(configs)) == len(configs)
            clustered = [c for c in configs if c.variant in cuda_kernels.CLUSTER_VARIANTS]
            assert bool(clustered) == (tokens == 1)  # the cluster kernel takes one token
            for config in configs:
                assert config.variant in cuda_kernels.VARIANT_ENTRY_BITS
                assert config.block_groups % cuda_kernels.GROUPS_PER_CHUNK == 0
                assert config.split == -(-groups // config.block_groups)
                chunks = config.block_groups // cuda_kernels.GROUPS_PER_CHUNK
                if config.variant in cuda_kernels.CLUSTER_VARIANTS:
                    assert chunks <= cuda_kernels.CLUSTER_MAX_CHUNKS[config.block_rows]
                    assert config.split <= cuda_kernels.CLUSTER_MAX_RANKS
                    assert (config.split - 1) * config.block_groups < groups  # no rank without groups
                    continue
                assert config.block_rows % cuda_kernels.ROWS_PER_BATCH == 0
                entry_bits = cuda_kernels.VARIANT_ENTRY_BITS[config.variant]
                assert cuda_kernels.shared_bytes(entry_bits, tokens, chunks) <= cuda_kernels.MAX_SHARED_BYTES


def test_kernel_applies_only_to_2x8_on_cuda():
    generator = torch.Generator().manual_seed(1)
    packed = gk.as_packed(random_2x8(64, 16, False, generator))
    assert not cuda_kernels.applies(packed, 1)  # on the CPU
    assert gk.default_config(packed, 1).variant == "direct"  # so the Triton kernels serve it


def packed_reference(ws: list[QuantizedWeights], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 outputs of the packed linears [T, rows], and the sum over the row's look-ups of
    |table entry| * |scale| [T, rows]: fp16 table entries are each rounded by at most 2^-11 of themselves,
    so that sum times 2^-11 bounds what fp16 tables add to the error."""
    outputs, magnitudes = [], []
    for w in ws:
        codebooks = w.codebooks.double()  # [2, 256, 8]
        codewords = torch.stack([codebooks[m][w.codes[..., m].long()] for m in range(2)], dim=2)  # [rows, G, 2, 8]
        groups = x.double().view(x.shape[0], 1, -1, 1, 8)  # [T, 1, G, 1, 8]
        entries = (codewords.unsqueeze(0) * groups).sum(-1)  # [T, rows, G, 2]
        scales = w.scales.double()
        outputs.append(entries.sum((-1, -2)) * scales + (0 if w.bias is None else w.bias.double()))
        magnitudes.append(entries.abs().sum((-1, -2)) * scales.abs())
    return torch.cat(outputs, dim=-1), torch.cat(magnitudes, dim=-1)


def qkv_like_case(seed: int, tokens: int):
    """The kernels' test case on the GPU, built: three q/k/v-like matrices over 40 groups (700, 256 and 300
    rows, biases on the first and last: a ragged last chunk and partial row blocks), packed, with the CUDA
    extension loaded; x [tokens, 320] bf16. Returns (ws, packed, x, expected, magnitude) (packed_reference)."""
    generator = torch.Generator().manual_seed(seed)
    ws = [random_2x8(rows, 40, bias, generator, "cuda", torch.bfloat16)
          for rows, bias in ((700, True), (256, False), (300, True))]
    packed = gk.pack_weights(ws)
    cuda_kernels.load_extension()
    x = torch.randn(tokens, 320, generator=generator).to("cuda", torch.bfloat16)
    expected, magnitude = packed_reference(ws, x)
    return ws, packed, x, expected, magnitude


def assert_within_rounding(out: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, entry_bits: int,
                           config) -> None:
    """Each element within two bf16 steps of the float64 reference (fp32 tables), plus 2^-11 of the
    look-ups' magnitudes (fp16 tables)."""
    step = 2.0 ** (torch.floor(torch.log2(expected.abs().clamp_min(1e-30))) - 7)
    allowed = 2 * step + 1e-3 + (magnitude * 2.0 ** -11 if entry_bits == 16 else 0)
    excess = (out.double() - expected).abs() / allowed
    worst = int(excess.argmax())
    assert float(excess.max()) <= 1.0, (f"{config.label()}: element {worst} is {out.flatten()[worst].item()}, "
                                        f"expected {expected.flatten()[worst].item()} within "
                                        f"{allowed.flatten()[worst].item():.3g}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", sorted(set(cuda_kernels.VARIANT_ENTRY_BITS) - set(cuda_kernels.CLUSTER_VARIANTS)))
@pytest.mark.parametrize("tokens", [1, 3])
def test_cuda_kernel_equals_dense_reference(variant, tokens):
    """q/k/v-like matrices packed into one launch, biases on two, a ragged last chunk (40 groups) and a
    partial row block; poisoned output; two launches in a row (the split-K state is left at zero)."""
    ws, packed, x, expected, magnitude = qkv_like_case(seed=2, tokens=tokens)
    entry_bits = cuda_kernels.VARIANT_ENTRY_BITS[variant]
    tested = 0
    for chunks in (1, 2):
        if cuda_kernels.shared_bytes(entry_bits, tokens, chunks) > cuda_kernels.MAX_SHARED_BYTES:
            continue  # candidate_configs never offers it
        tested += 1
        config = cuda_kernels.make_config(packed, variant, 256, chunks)
        for _ in range(2):
            out = torch.full((tokens, packed.rows), float("nan"), dtype=torch.bfloat16, device="cuda")
            gk._launch(x, packed, config, out)
            assert gk.relative_error(out, expected) < 1e-2, config
            assert_within_rounding(out, expected, magnitude, entry_bits, config)
        assert int(gk._counters(x.device).abs().sum()) == 0
        assert float(gk._accumulator(x.device, 1).abs().sum()) == 0.0
    assert tested >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", cuda_kernels.CLUSTER_VARIANTS)
def test_cluster_kernel_equals_dense_reference(variant):
    """The cluster kernel on q/k/v-like packed matrices (biases on two, partial row blocks) over 40 groups:
    clusters of 3 (a ragged last chunk), 2 and 1 CTAs, 256 and 128 rows per CTA; poisoned output,
    two launches in a row."""
    ws, packed, x, expected, magnitude = qkv_like_case(seed=3, tokens=1)
    configs = [gk.KernelConfig(variant, rows, 16 * chunks, -(-40 // (16 * chunks)), 8)
               for rows, chunks in ((256, 1), (256, 3), (128, 2), (128, 1))]
    assert sorted({c.split for c in configs}) == [1, 2, 3]
    for config in configs:
        for _ in range(2):
            out = torch.full((1, packed.rows), float("nan"), dtype=torch.bfloat16, device="cuda")
            gk._launch(x, packed, config, out)
            assert gk.relative_error(out, expected) < 1e-2, config
            assert_within_rounding(out, expected, magnitude, cuda_kernels.VARIANT_ENTRY_BITS[variant], config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_codes_give_the_same_outputs():
    """Codes in tiles (packed.in_tiles): the split-K kernel (one and three tokens, both table kinds, 256- and
    512-row CTAs across the matrices' bounds, a ragged last chunk of CTAs, with open sums too) and the cluster
    kernel (256 and 128 rows) give what they give on row-major codes: to the bit with one split; with several,
    whose atomic additions land in any order, within an fp32 rounding of the sums (a bf16 step of the outputs).
    A code read from the wrong place changes an output by about its own size."""
    from aqflow.inference.packed import in_tiles

    generator = torch.Generator().manual_seed(5)
    ws = [random_2x8(rows, 48, bias, generator, "cuda", torch.bfloat16)
          for rows, bias in ((512, True), (256, False), (768, True))]
    packed = gk.pack_weights(ws)
    tiled = in_tiles(packed)
    assert tiled.tiled
    cuda_kernels.load_extension()
    for tokens in (1, 3):
        x = torch.randn(tokens, 384, generator=generator).to("cuda", torch.bfloat16)
        configs = [cuda_kernels.make_config(packed, variant, rows, chunks) for variant in cuda_kernels.SPLIT_K_VARIANTS
                   for rows in (256, 512) for chunks in (1, 2)
                   if cuda_kernels.shared_bytes(cuda_kernels.VARIANT_ENTRY_BITS[variant], tokens, chunks)
                   <= cuda_kernels.MAX_SHARED_BYTES]  # what candidate_configs offers
        if tokens == 1:
            configs += [gk.KernelConfig(variant, rows, 16 * chunks, -(-48 // (16 * chunks)), 8)
                        for variant in cuda_kernels.CLUSTER_VARIANTS for rows, chunks in ((256, 2), (128, 1))]
        for config in configs:
            outs = []
            for operand in (packed, tiled):
                out = torch.full((tokens, packed.rows), float("nan"), dtype=torch.bfloat16, device="cuda")
                outs.append(gk._launch(x, operand, config, out))
                if config.variant in cuda_kernels.SPLIT_K_VARIANTS:
                    sums = torch.zeros(tokens, packed.rows, dtype=torch.float32, device="cuda")
                    outs.append(cuda_kernels.launch_open(x, operand, config, sums))
            half = len(outs) // 2
            for row_major, in_tiles_ in zip(outs[:half], outs[half:]):
                if config.split == 1:
                    assert torch.equal(row_major, in_tiles_), config
                else:
                    torch.testing.assert_close(in_tiles_, row_major, rtol=2.0 ** -7, atol=1e-3, msg=str(config))
            assert not torch.isnan(outs[0]).any(), config
