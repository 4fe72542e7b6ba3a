import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from aqflow.inference.decode import (ARGMAX_ROW, fuse_projections, greedy_decode, greedy_token, new_static_cache,
                                     step_logits)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return model


def hf_greedy(model, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """transformers' own greedy generation (no end-of-sequence token in these configs)."""
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, input_ids.shape[1]:].tolist()


def prompt(length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_tokens_equal_transformers_generate():
    model = tiny_llama()
    input_ids = prompt()
    reference = hf_greedy(model, input_ids, 12)
    streamed = []
    tokens, timings = greedy_decode(model, input_ids, 12, on_token=streamed.append)
    assert tokens.tolist() == reference
    assert streamed == reference
    assert timings.mode == "eager" and timings.new_tokens == 12 and timings.timed_steps == 11
    assert timings.prompt_tokens == 7 and timings.decode_tokens_per_second > 0


def test_static_cache_step_logits_equal_full_forward():
    """Each decode step's logits (static cache, one token) equal the full forward over the whole sequence."""
    model = tiny_llama()
    sequence = prompt(10)
    with torch.no_grad():
        full = model(sequence).logits[0]  # [10, vocab]
        cache = new_static_cache(model, 16)
        model(input_ids=sequence[:, :6], position_ids=torch.arange(6)[None], past_key_values=cache, use_cache=True)
        for position in range(6, 10):
            logits = step_logits(model, cache, sequence[:, position:position + 1], torch.tensor([[position]]))
            torch.testing.assert_close(logits[0], full[position], rtol=1e-5, atol=1e-5)


def test_stop_token_ends_decoding():
    model = tiny_llama()
    tokens, _ = greedy_decode(model, prompt(), 12)
    stop = tokens[4].item()
    first = tokens.tolist().index(stop)
    stopped, timings = greedy_decode(model, prompt(), 12, stop_tokens={stop})
    assert stopped.tolist() == tokens[:first + 1].tolist()
    assert timings.new_tokens == first + 1


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_fused_projections_give_equal_logits(build):
    model = build()
    sequence = prompt(9)
    with torch.no_grad():
        before = model(sequence).logits
        fused = fuse_projections(model)
        after = model(sequence).logits
    assert len(fused) == 2 * model.config.num_hidden_layers
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" in fused
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "FusedProjectionMember"
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    tokens, _ = greedy_decode(model, sequence, 5)
    assert tokens.tolist() == hf_greedy(model, sequence, 5)


def quantized_twins(config: LlamaConfig, seed: int = 3) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(a Llama whose decoder projections are random 2x8 kernel linears, the same Llama holding their dense
    weights)."""
    from aqflow.inference.gpu_kernels import KernelQuantizedLinear
    from aqflow.inference.layout import QuantizedWeights, dense_weight

    torch.manual_seed(0)
    quantized, dense = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    dense.load_state_dict(quantized.state_dict())
    generator = torch.Generator().manual_seed(seed)
    for (name, module), dense_module in zip(list(quantized.named_modules()), list(dense.modules())):
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers"):
            w = QuantizedWeights(
                codes=torch.randint(0, 256, (module.out_features, module.in_features // 8, 2), generator=generator).to(torch.uint8),
                codebooks=torch.randn(2, 256, 8, generator=generator) * 0.1, scales=torch.rand(module.out_features, generator=generator) + 0.5,
                bias=None, nbits=8)
            parent, _, attribute = name.rpartition(".")
            setattr(quantized.get_submodule(parent), attribute, KernelQuantizedLinear(w))
            dense_module.weight.data = dense_weight(w)
    return quantized, dense


def assert_decodes_as(quantized, dense, sequence: torch.Tensor, new_tokens: int) -> None:
    """The same logits on `sequence` and the same greedy tokens (the quantized model unfused by the decode)."""
    with torch.no_grad():
        torch.testing.assert_close(quantized(sequence).logits, dense(sequence).logits, rtol=1e-4, atol=1e-4)
    expected, _ = greedy_decode(dense, sequence, new_tokens)
    tokens, _ = greedy_decode(quantized, sequence, new_tokens, fuse=False)
    assert tokens.tolist() == expected.tolist()


def test_quantized_model_decodes_as_its_dense_equivalent():
    """A tiny Llama whose projections are 2x8 kernel linears (Triton's interpreter here) decodes the
    same tokens, with the same logits, as the model holding their dense weights; fused q/k/v and
    gate/up (one launch each) too."""
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    quantized, dense = quantized_twins(config)
    sequence = prompt(5)
    assert_decodes_as(quantized, dense, sequence, 3)
    assert len(fuse_projections(quantized)) == 2
    assert type(quantized.model.layers[0].self_attn.q_proj.fused).__name__ == "FusedQuantizedLinear"
    with torch.no_grad():
        torch.testing.assert_close(quantized(sequence).logits, dense(sequence).logits, rtol=1e-4, atol=1e-4)


def test_quantized_projections_read_tiled_codes_after_fusing():
    """Where a 2-bit projection's rows and groups are whole tiles (256 x 16), fuse_projections leaves it reading
    tiled codes: gate/up fused, o_proj and down_proj each an operand of its own; q/k/v (k and v have 128 rows)
    stays row-major. The logits and greedy tokens stay those of the dense twin."""
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    quantized, dense = quantized_twins(config)
    fuse_projections(quantized)
    layer = quantized.model.layers[0]
    assert layer.mlp.gate_proj.fused.packed.tiled and not layer.self_attn.q_proj.fused.packed.tiled
    for single in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert type(single).__name__ == "FusedQuantizedLinear" and single.packed.tiled
    assert_decodes_as(quantized, dense, prompt(3), 2)


def test_failed_compile_falls_back_to_the_plain_step(monkeypatch):
    """A torch.compile whose compiled forward fails at its first call (where compiling happens) leaves the
    decode to the plain forward: the same tokens, the mode and error recorded."""
    model = tiny_llama()
    expected, _ = greedy_decode(model, prompt(), 6)

    def broken_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor exploded")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    tokens, timings = greedy_decode(model, prompt(), 6, compile=True)
    assert tokens.tolist() == expected.tolist()
    assert timings.mode == "eager" and "inductor exploded" in timings.compile_error


def test_greedy_token_is_the_argmax_ties_to_the_first():
    """The two-stage argmax (CUDA's) equals logits.argmax(dim=-1) for vocabularies shorter than a row, one row, a row
    and one more, and a Llama-3-sized one, in float32 and bf16; a tie inside a row and one across rows go to the
    first, as with the plain argmax a CPU takes."""
    generator = torch.Generator().manual_seed(0)
    for vocabulary in (5, ARGMAX_ROW, ARGMAX_ROW + 1, 128256):
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(1, vocabulary, generator=generator).to(dtype)
            assert torch.equal(greedy_token(logits, two_stage=True), logits.argmax(dim=-1)), (vocabulary, dtype)
            last = vocabulary - 1
            logits[0, last] = logits[0, last // 2] = 50.0  # across rows when the vocabulary has several
            assert greedy_token(logits, two_stage=True).tolist() == [last // 2]
            logits[0, 1] = logits[0, 3] = 60.0  # inside the first row
            assert greedy_token(logits, two_stage=True).tolist() == greedy_token(logits).tolist() == [1]
