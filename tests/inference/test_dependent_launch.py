"""Programmatic dependent launch: the switch and its errors (here), and on a Hopper GPU (run there with
TRITON_INTERPRET=0) kernels launched with it read what the kernel before them wrote: chained GEMVs
equal the reference, and a graphed decode makes the same tokens with it as without it."""

import pytest
import torch
from torch._inductor import config as inductor_config
from transformers import LlamaConfig, LlamaForCausalLM

from aqflow.inference import cuda_kernels, dependent_launch, gpu_kernels as gk
from aqflow.inference.decode import greedy_decode

from tests.inference.test_cuda_kernels import assert_within_rounding, packed_reference, random_2x8

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a CUDA GPU of compute capability >= 9.0")


def test_enabled_sets_the_switch_and_gives_it_back():
    inductor_has_it = hasattr(inductor_config.triton, "enable_pdl")
    before = inductor_config.triton.enable_pdl if inductor_has_it else None
    assert not dependent_launch.active()
    with dependent_launch.enabled(True):
        assert dependent_launch.active()
        if inductor_has_it:
            assert inductor_config.triton.enable_pdl is True
        with dependent_launch.enabled(False):
            assert not dependent_launch.active()
        assert dependent_launch.active()
    assert not dependent_launch.active()
    with pytest.raises(KeyError):
        with dependent_launch.enabled(True):
            raise KeyError("a failure inside")
    assert not dependent_launch.active()
    if inductor_has_it:
        assert inductor_config.triton.enable_pdl == before


def tiny_llama(hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def llama_with_kernel_linears(hidden: int, seed: int) -> tuple[LlamaForCausalLM, torch.Generator]:
    """tiny_llama(hidden) in bf16 on CUDA with every decoder linear a random 2x8 KernelQuantizedLinear, and
    the generator that drew the codes (for the prompt)."""
    model = tiny_llama(hidden=hidden).to("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers"):
            w = random_2x8(module.out_features, module.in_features // 8, False, generator, "cuda", torch.bfloat16)
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, gk.KernelQuantizedLinear(w))
    return model, generator


def test_asking_for_it_on_a_cpu_is_an_error():
    model = tiny_llama()
    prompt = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="dependent_launch=True.*cpu"):
        greedy_decode(model, prompt, 2, dependent_launch=True)
    _, timings = greedy_decode(model, prompt, 2)
    assert timings.dependent_launch is False


def test_a_compiled_step_is_not_reused_under_the_other_setting(monkeypatch):
    """greedy_decode compiles its step per launch setting: with and without PDL, then with it again, are
    two compiles (a new closure of the same code is otherwise reused, inductor's kernels and all)."""
    import aqflow.inference.decode as decode_module

    compiles = []

    def counting_backend(graph_module, example_inputs):
        compiles.append(len(graph_module.graph.nodes))
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=counting_backend, **kwargs))
    monkeypatch.setattr(decode_module, "dependent_launch_supported", lambda device: True)
    model = tiny_llama()
    prompt = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(3))
    runs = [greedy_decode(model, prompt, 3, compile=True, dependent_launch=flag) for flag in (True, False, True)]
    assert [r[1].dependent_launch for r in runs] == [True, False, True]
    assert runs[0][0].tolist() == runs[1][0].tolist() == runs[2][0].tolist()
    assert len(compiles) == 2


@hopper
@pytest.mark.parametrize("variants", [("cuda_lut32", "cuda_lut16"), ("cuda_cluster32", "cuda_cluster16")])
def test_chained_gemvs_read_what_the_kernel_before_wrote(variants):
    """GEMV B reads GEMV A's output, the buffer poisoned before each pair: launched with PDL, B equals
    the reference of A's output as written, as without."""
    generator = torch.Generator().manual_seed(4)
    wa = random_2x8(512, 40, False, generator, "cuda", torch.bfloat16)
    wb = random_2x8(300, 64, True, generator, "cuda", torch.bfloat16)
    pa, pb = gk.pack_weights([wa]), gk.pack_weights([wb])
    cuda_kernels.load_extension()
    x = torch.randn(1, 320, generator=generator).to("cuda", torch.bfloat16)
    first, second = variants
    cluster = first in cuda_kernels.CLUSTER_VARIANTS
    config_a = (gk.KernelConfig(first, 256, 16, 3, 8) if cluster else cuda_kernels.make_config(pa, first, 256, 1))
    config_b = (gk.KernelConfig(second, 128, 32, 2, 8) if cluster else cuda_kernels.make_config(pb, second, 256, 2))
    expected_mid, _ = packed_reference([wa], x)
    for pdl in (False, True):
        with dependent_launch.enabled(pdl):
            for _ in range(3):
                mid = torch.full((1, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                out = torch.full((1, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
                gk._launch(x, pa, config_a, mid)
                gk._launch(mid, pb, config_b, out)
                torch.cuda.synchronize()
                assert gk.relative_error(mid, expected_mid) < 1e-2
                expected, magnitude = packed_reference([wb], mid)
                assert_within_rounding(out, expected, magnitude, cuda_kernels.VARIANT_ENTRY_BITS[second], config_b)


@hopper
def test_graphed_decode_makes_the_same_tokens_with_it():
    """A tiny Llama with 2x8 kernel linears, decoded in a CUDA graph (GEMVs, one-token attention) with and
    without PDL: the same tokens."""
    model, generator = llama_with_kernel_linears(64, seed=5)
    prompt = torch.randint(0, 97, (1, 6), generator=generator)
    runs = {pdl: greedy_decode(model, prompt, 12, compile=False, dependent_launch=pdl) for pdl in (False, True)}
    assert runs[True][1].dependent_launch and not runs[False][1].dependent_launch
    assert runs[True][1].mode == "graph"
    assert runs[True][0].tolist() == runs[False][0].tolist()
