"""The per-process memory plan (aqflow.pvtune.memory) from checkpoint headers: what it divides over
processes, where it puts the V-step's state, and what it names when nothing fits."""

import pytest

from aqflow.models.folder import TensorHeader
from aqflow.pvtune.memory import PVMemoryError, host_bytes, plan_v_state, smallest_world, state_bytes
from aqflow.pvtune.train import PVSettings

GIB = 2**30


def llama_headers(layers: int = 4, width: int = 256, mlp: int = 512, vocab: int = 1000):
    """Teacher and 2x8-bit student headers of a small Llama (untied head)."""
    teacher, student = {}, {}
    shapes = {"self_attn.q_proj": (width, width), "self_attn.o_proj": (width, width), "mlp.up_proj": (mlp, width),
              "mlp.down_proj": (width, mlp)}
    for block in range(layers):
        for name, (out, inp) in shapes.items():
            prefix = f"model.layers.{block}.{name}"
            teacher[f"{prefix}.weight"] = TensorHeader("BF16", (out, inp))
            student[f"{prefix}.codes"] = TensorHeader("U8", (out, inp // 8, 2))
            student[f"{prefix}.codebooks"] = TensorHeader("F16", (2, 256, 1, 8))
            student[f"{prefix}.scales"] = TensorHeader("F16", (out, 1, 1, 1))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            teacher[f"model.layers.{block}.{norm}.weight"] = student[f"model.layers.{block}.{norm}.weight"] = \
                TensorHeader("BF16", (width,))
    for name, shape in {"model.embed_tokens.weight": (vocab, width), "lm_head.weight": (vocab, width),
                        "model.norm.weight": (width,)}.items():
        teacher[name] = student[name] = TensorHeader("BF16", shape)
    return student, teacher


def test_processes_divide_the_sharded_parts_and_keep_the_whole_ones():
    student, teacher = llama_headers()
    settings = PVSettings()
    one, two = (state_bytes(student, teacher, 2, settings, size) for size in (1, 2))
    for part in ("teacher", "v_step", "non_quantized"):
        assert two[part] == -(-one[part] // 2), part
    for part in ("codes", "codebooks_and_scales"):
        assert two[part] == one[part], part
    assert "gathered" not in one and two["gathered"] > 0
    weights = 4 * (2 * 256 * 256 + 2 * 256 * 512)
    assert one["v_step"] == 12 * weights  # straight-through copy, gradient, one moment (code_beta1 0)
    on_host = state_bytes(student, teacher, 2, settings, 1, "host")
    assert on_host["v_step"] == 4 * weights  # only the gradient
    assert on_host["non_quantized"] == one["non_quantized"] // 2  # weights and gradients; the moments moved
    assert host_bytes(student, settings) == 8 * weights + one["non_quantized"] // 2


def test_the_v_state_goes_to_the_host_only_where_the_card_is_too_small_and_one_process_runs():
    student, teacher = llama_headers()
    settings = PVSettings()
    on_card = sum(state_bytes(student, teacher, 2, settings).values())
    on_host = sum(state_bytes(student, teacher, 2, settings, 1, "host").values())
    assert plan_v_state(student, teacher, 2, settings, 1, on_card, 100 * GIB, "cuda:0")[0] == "device"
    assert plan_v_state(student, teacher, 2, settings, 1, on_card - 1, 100 * GIB, "cuda:0") == \
        ("host", state_bytes(student, teacher, 2, settings, 1, "host"))
    with pytest.raises(PVMemoryError, match="needs .* GiB per process") as error:  # too little host memory
        plan_v_state(student, teacher, 2, settings, 1, on_card - 1, host_bytes(student, settings) - 1, "cuda:0")
    fewest = smallest_world(lambda size: sum(state_bytes(student, teacher, 2, settings, size).values()) <= on_card - 1)
    assert fewest == 2 and "fits on 2 processes on cards of this size" in str(error.value)
    assert "host memory" in str(error.value)  # the single-card option is named with what it needs
    with pytest.raises(PVMemoryError, match="host memory") as error:  # the user asked for the card alone
        plan_v_state(student, teacher, 2, PVSettings(v_state="device"), 1, on_card - 1, 100 * GIB, "cuda:0")
    assert on_host < on_card - 1
