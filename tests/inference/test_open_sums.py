"""Open sums (aqflow.inference.open_sums): the split-K kernel adds its unscaled sums into a zeroed buffer and
torch finishes them. On a CPU only the refusal is tested; on a GPU (run there with TRITON_INTERPRET=0) the
finished product equals the dense reference, and a decode makes the same tokens with open sums as without."""

import pytest
import torch

from aqflow.inference import cuda_kernels, gpu_kernels as gk
from aqflow.inference.decode import greedy_decode
from aqflow.inference.open_sums import open_sums_enabled, open_sums_sites

from tests.inference.test_cuda_kernels import assert_within_rounding, qkv_like_case
from tests.inference.test_dependent_launch import llama_with_kernel_linears, tiny_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_open_sums_are_refused_on_a_cpu():
    model = tiny_llama()
    with pytest.raises(ValueError, match="open_sums=True"):
        greedy_decode(model, torch.zeros(1, 3, dtype=torch.long), 2, open_sums=True)
    with open_sums_enabled(model) as sums:  # nothing on a CPU takes them
        assert sums.buffers == []


@cuda
@pytest.mark.parametrize("variant", ["cuda_lut32", "cuda_lut16"])
def test_open_sums_finished_by_torch_equal_the_dense_reference(variant):
    """q/k/v-like matrices, biases on two, a ragged last chunk and a partial row block, one and several
    splits: the product from open sums is within rounding of the float64 reference, and the sums it leaves
    are the unscaled ones."""
    ws, packed, x, expected, magnitude = qkv_like_case(seed=6, tokens=1)
    entry_bits = cuda_kernels.VARIANT_ENTRY_BITS[variant]
    for chunks in (1, 2, 3):  # 3, 2 and 1 splits of the 40 groups
        config = cuda_kernels.make_config(packed, variant, 256, chunks)
        sums = torch.zeros(1, packed.rows, dtype=torch.float32, device="cuda")
        out = gk.open_packed_matmul(x, packed, config.as_list(), sums)
        assert out.dtype == torch.bfloat16 and out.shape == (1, packed.rows)
        assert_within_rounding(out, expected, magnitude, entry_bits, config)
        bias = torch.cat([w.bias.double() if w.bias is not None else torch.zeros(w.out_features, device="cuda",
                                                                                  dtype=torch.float64) for w in ws])
        unscaled = (expected - bias) / packed.scales.double()
        assert gk.relative_error(sums, unscaled) < 1e-2, config


@cuda
def test_a_decode_with_open_sums_makes_the_same_tokens():
    """A tiny Llama (512 wide: its linears split their groups between CTAs) with 2x8 kernel linears,
    decoded in a CUDA graph with and without open sums, and compiled with them: the same 12 tokens. A step
    that did not start from zeroed sums would add the last step's into its products."""
    # seed 13: every greedy token leads its runner-up by >= 0.05 (dense, on a CPU); with seed 8 the 7th led by one
    # bf16 step, and the split-K kernels' summation order (its configuration) decided it
    model, generator = llama_with_kernel_linears(512, seed=13)
    prompt = torch.randint(0, 97, (1, 6), generator=generator)
    closed, closed_timings = greedy_decode(model, prompt, 12, compile=False, open_sums=False)
    graphed, graphed_timings = greedy_decode(model, prompt, 12, compile=False, open_sums=True)
    compiled, compiled_timings = greedy_decode(model, prompt, 12, compile=True)
    assert closed_timings.open_sums == 0
    assert graphed_timings.open_sums == compiled_timings.open_sums == 8  # 2 layers x (q/k/v, o, gate/up, down)
    assert graphed_timings.mode == "graph" and compiled_timings.mode == "compile+graph"
    assert graphed.tolist() == closed.tolist() == compiled.tolist()
    splits = [gk.config_for(site.packed, 1).split for _, site in open_sums_sites(model)]
    assert max(splits) > 1  # the split-K path itself was exercised
    token, position = prompt[:, :1].cuda(), torch.zeros(1, 1, dtype=torch.long, device="cuda")
    for forward in (model, torch.compile(model)):  # the open path is the one taken, eager and compiled
        with open_sums_enabled(model) as sums, torch.inference_mode():
            forward(input_ids=token, position_ids=position)
            assert all(float(b.abs().sum()) > 0 for b in sums.buffers)
