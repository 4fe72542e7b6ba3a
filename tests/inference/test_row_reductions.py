"""One-pass row reductions: which reductions the compiled decode step keeps whole (here), the context's switch
and inductor's handler; on a GPU (run there with TRITON_INTERPRET=0), an RMSNorm row compiled inside it is one
persistent kernel with the reference's values."""

import pytest
import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor.sizevars import SizeVarAllocator
from torch._inductor.virtualized import V

from aqflow.inference import row_reductions


def test_only_single_rows_up_to_the_limit_are_kept_whole():
    sizes = SizeVarAllocator()
    one, unknown = sympy.Integer(1), sympy.Symbol("s0", positive=True, integer=True)
    assert row_reductions.keeps_row_whole(sizes, one, sympy.Integer(3072))
    assert row_reductions.keeps_row_whole(sizes, one, sympy.Integer(row_reductions.ROW_LIMIT))
    assert not row_reductions.keeps_row_whole(sizes, one, sympy.Integer(row_reductions.ROW_LIMIT + 1))
    assert not row_reductions.keeps_row_whole(sizes, sympy.Integer(2), sympy.Integer(3072))  # more rows: inductor's
    assert not row_reductions.keeps_row_whole(sizes, unknown, sympy.Integer(3072))  # a row count not known
    assert not row_reductions.keeps_row_whole(sizes, one, unknown)


def test_the_context_installs_its_choices_and_gives_them_back():
    before = type(V.choices)
    assert not row_reductions.active()
    with row_reductions.one_pass_rows(True) as on:
        assert on and row_reductions.active()
        assert type(V.choices).__name__ == "OnePassRowChoices"
        assert V.choices.uuid().startswith("aqflow-one-pass-rows")
        keyed = getattr(inductor_config, "inductor_choices_class", None) is not None
        assert keyed or not inductor_config.fx_graph_cache  # never a cache that could serve another compile
    assert type(V.choices) is before and not row_reductions.active()
    with row_reductions.one_pass_rows(False) as on:
        assert not on and not row_reductions.active()
    with pytest.raises(KeyError):
        with row_reductions.one_pass_rows(True):
            raise KeyError("a failure inside")
    assert type(V.choices) is before and not row_reductions.active()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton kernels)")
def test_a_compiled_rmsnorm_row_is_one_persistent_kernel_with_the_references_values():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    generator = torch.Generator(device="cuda").manual_seed(0)
    x, residual, weight = (torch.randn(1, 1, 3072, device="cuda", generator=generator).bfloat16() for _ in range(3))

    def add_norm(x, residual, weight):
        h = (x + residual).float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()

    expected = add_norm(x, residual, weight).double()
    with row_reductions.one_pass_rows(True):
        out, codes = run_and_get_code(torch.compile(add_norm, dynamic=False), x, residual, weight)
    code = "\n".join(codes)
    assert "triton_per_" in code and "triton_red_" not in code
    # the reference rounds to bf16 twice (the normalized row, then its product with the weight), the compiled
    # kernel once, and sums the squares in another order: two bf16 steps apart at most
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a compiled, graphed decode)")
def test_a_graphed_decode_makes_the_same_tokens_with_one_pass_rows_as_without():
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqflow.inference.decode import greedy_decode

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)  # rows of 2,048: looped by default
    model = LlamaForCausalLM(config).eval().to("cuda")
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    runs = {}
    for flag in (False, True):
        torch._dynamo.reset()
        runs[flag] = greedy_decode(model, prompt, 12, one_pass_rows=flag)
    assert runs[True][1].one_pass_rows and not runs[False][1].one_pass_rows
    assert runs[True][1].mode == runs[False][1].mode == "compile+graph"
    assert runs[True][0].tolist() == runs[False][0].tolist()
