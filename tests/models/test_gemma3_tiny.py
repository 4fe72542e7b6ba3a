"""The second architecture of the paper grid, Gemma 3, through the whole pipeline on the CPU.

Gemma3-270M itself is a 253 MB download and a GPU's work; its architecture (q/k norms, four norms
per block, scaled embeddings, sliding-window layers, GELU-tanh MLP) is what the pipeline must
handle, so a seeded random Gemma3ForCausalLM of two blocks, as a `path:` model, stands in for it.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "tests" / "workflow" / "config.tiny.yaml").read_text())
LINEARS_PER_BLOCK = 7  # q, k, v, o, gate, up, down


def build_tiny_gemma3(out_dir: Path, num_layers: int = 2) -> Path:
    """A seeded random Gemma3ForCausalLM (hidden 64, 4 heads of 16, 2 kv heads, window 32) with the
    tiny byte-level tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from aqflow.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(out_dir)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=32,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


@pytest.mark.slow
def test_a_tiny_gemma3_is_quantized_pv_tuned_and_evaluated(tmp_path):
    model = build_tiny_gemma3(tmp_path / "tinygemma")
    config = dict(TINY, models={"tinygemma": {"path": str(model), "dtype": "float32"}},
                  targets=[{"model": "tinygemma", "bpp": 2, "init": "oaem", "beam": 2}])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))
    target = "results/tinygemma/2bpp/oaem/b2/eval.json"
    result = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(path),
                             "--directory", str(tmp_path), "-c2", "--", target],
                            capture_output=True, text=True, env=env, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / target).read_text())
    # every projection of both blocks quantized into the AQLM format; the norms and embeddings not
    assert record["storage"]["format"] == "aqlm" and record["storage"]["quantized_linears"] == 2 * LINEARS_PER_BLOCK
    for stage in (record["pre_pv"]["metrics"], record["metrics"]):
        for domain in ("wikitext2-standin", "c4-standin"):
            assert math.isfinite(stage[domain]["perplexity"]), (domain, stage[domain])
