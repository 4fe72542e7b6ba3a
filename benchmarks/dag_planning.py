"""Planning time of `snakemake -n` on a finished run at Llama-3.2-3B scale, with the DAG-time
integrity check (aqflow.jobs.currency): cold (every artifact hashed) and warm (every file recognised
by size, mtime, ctime and inode), against the same tree planned by a Snakefile without the check
(--baseline-src: a checkout of the commit before it). The tree is synthetic at the real sizes (the
6.4 GB model, 28 XᵀX NPZ of 10.7 GB, 196 layers at 2 bits, the stitched and PV-tuned checkpoints,
the evaluations), each written as aqflow writes it (sidecars, SHA256SUMS; bytes a repeated random
block, since hashing costs the same for any bytes); `snakemake --touch -F` then records Snakemake's
metadata as a finished run has it.

    PYTHONPATH=src python benchmarks/dag_planning.py --workdir /tmp/plan3b --baseline-src /tmp/before [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTERMEDIATE, BLOCKS, HEADS, KV_HEADS, VOCAB = 3072, 8192, 28, 24, 8, 128256
HEAD_DIM = HIDDEN // HEADS
LINEARS = {  # name -> (out, in)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE)}
# XᵀX sites of a block: the linears that share an input share its XᵀX
SITES = {"self_attn.q_proj": HIDDEN, "self_attn.o_proj": HIDDEN, "mlp.gate_proj": HIDDEN, "mlp.down_proj": INTERMEDIATE}
BLOCK = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()  # 16 MiB


def fill(handle, size: int) -> None:
    """Write `size` bytes of the repeated random block."""
    while size > 0:
        chunk = BLOCK[: min(size, len(BLOCK))]
        handle.write(chunk)
        size -= len(chunk)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file of these (dtype, shape) tensors, streamed (no tensor held in memory)."""
    bits = {"F16": 2, "I8": 1, "F32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = bits[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        fill(handle, offset)


def write_npz(path: Path, arrays: dict[str, tuple[int, int]]) -> None:
    """An uncompressed NPZ of float32 [n, n] arrays, streamed."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, shape in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": shape})
                fill(member, 4 * shape[0] * shape[1])


def layer_names() -> list[str]:
    return [f"model.layers.{block}.{name}" for block in range(BLOCKS) for name in LINEARS]


def checkpoint_tensors(quantized: bool) -> dict:
    """The tensors of the fetched model (float16) or of an AQLM checkpoint (codes, codebooks, scales)."""
    tensors = {"model.embed_tokens.weight": ("F16", (VOCAB, HIDDEN)), "model.norm.weight": ("F16", (HIDDEN,))}
    for block in range(BLOCKS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{block}.{norm}.weight"] = ("F16", (HIDDEN,))
        for name, (out, inp) in LINEARS.items():
            prefix = f"model.layers.{block}.{name}"
            if quantized:
                tensors.update({f"{prefix}.codes": ("I8", (out, inp // 8, 2)),
                                f"{prefix}.codebooks": ("F16", (2, 256, 1, 8)), f"{prefix}.scales": ("F16", (out, 1, 1, 1))})
            else:
                tensors[f"{prefix}.weight"] = ("F16", (out, inp))
    return tensors


def model_config(quantized: bool) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": BLOCKS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "torch_dtype": "float16"}
    if quantized:
        config["quantization_config"] = {"quant_method": "aqlm", "num_codebooks": 2, "nbits_per_codebook": 8,
                                         "in_group_size": 8, "out_group_size": 1, "linear_weights_not_to_quantize": []}
    return config


def model_folder(target: Path, quantized: bool) -> None:
    from aqflow.io import artifacts

    with artifacts.atomic_dir(target) as staging:
        (staging / "config.json").write_text(json.dumps(model_config(quantized)))
        write_safetensors(staging / "model.safetensors", checkpoint_tensors(quantized))


def write_tree(workdir: Path, config: dict) -> None:
    """Every output of a finished run of `config`'s one target, as aqflow writes it."""
    import pandas as pd

    from aqflow.io import artifacts
    from aqflow.jobs.plan import WorkflowPlan

    os.chdir(workdir)
    plan = WorkflowPlan(config)
    variant = plan.targets()[0]
    folder = "results/{model}/{bpp}bpp/{init}/{variant}".format(**variant)
    model_folder(Path("resources/models/m3b"), quantized=False)
    for corpus in ("c4-standin", "wikitext2-standin"):
        artifacts.write_parquet(f"resources/data/{corpus}.parquet", pd.DataFrame({"text": ["synthetic"] * 8}))
        artifacts.write_json(f"resources/data/{corpus}.split.json", {"calibration": [0], "evaluation": [1]})
    with artifacts.atomic_dir(Path(f"results/m3b/calib/{plan.calibration_id('m3b')}")) as staging:
        (staging / "calibration.json").write_text(json.dumps({"layers": layer_names(), "blocks": BLOCKS}))
        for block in range(BLOCKS):
            write_npz(staging / f"block{block}.npz", {f"xtx/{name}": (width, width) for name, width in SITES.items()})
        artifacts.write_parquet(staging / "manifest.parquet", pd.DataFrame({"site": list(SITES)}))
    for name in layer_names():
        out, inp = LINEARS[name.split(".", 3)[3]]
        path = Path(f"{folder}/layers/{name}.safetensors")
        path.parent.mkdir(parents=True, exist_ok=True)
        with artifacts.atomic_path(path) as tmp:
            write_safetensors(tmp, {"codes": ("I8", (out, inp // 8, 2)), "codebooks": ("F16", (2, 256, 1, 8)),
                                    "scales": ("F16", (out, 1, 1, 1))})
        artifacts.write_json(f"{folder}/layers/{name}.json", {"layer": name, "in_features": inp, "out_features": out})
    model_folder(Path(f"{folder}/model"), quantized=True)
    model_folder(Path(f"{folder}/pv/model"), quantized=True)
    artifacts.write_parquet(f"{folder}/pv/train_log.parquet", pd.DataFrame({"step": [0], "kl": [0.5]}))
    artifacts.write_json(f"{folder}/pv/pvtune.json", {"steps": 1})
    for path in (f"{folder}/eval_pre_pv.json", f"{folder}/eval.json", "results/m3b/fp/eval.json"):
        artifacts.write_json(path, {"metrics": {}})
    report = Path("results/report")
    report.mkdir(parents=True, exist_ok=True)
    for name in ("summary.csv", "summary.parquet", "pareto.png", "layers.png", "pvtune.png", "stage_times.csv"):
        artifacts.write_json(report / name, {})


def snakemake(src: Path, workdir: Path, config: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(src / "src"))
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(src / "Snakefile"), "--configfile",
                             str(config), "--directory", str(workdir), *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - started, result


def main() -> None:
    global BLOCKS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="an empty scratch folder (~21 GB)")
    parser.add_argument("--baseline-src", type=Path, help="a checkout without the DAG-time check, timed on the same tree")
    parser.add_argument("--keep", action="store_true", help="keep the tree")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="decoder blocks (28: Llama-3.2-3B; fewer: a smoke test)")
    args = parser.parse_args()
    BLOCKS = args.blocks
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=False)
    source = workdir.parent / f"{workdir.name}-source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(model_config(False)))
    tiny = yaml.safe_load((REPO / "tests/workflow/config.tiny.yaml").read_text())
    config = {**tiny, "targets": [{"model": "m3b", "bpp": 2, "init": "greedy", "beam": 8}],
              "models": {"m3b": {"path": str(source), "dtype": "float16"}}, "bitrates": {2: {"num_codebooks": 2, "nbits": 8}}}
    config_path = workdir.parent / f"{workdir.name}-config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    write_tree(workdir, validated(config_path))
    written = time.perf_counter() - started
    size = sum(path.stat().st_size for path in workdir.rglob("*") if path.is_file())
    seconds, result = snakemake(REPO, workdir, config_path, "--touch", "-F", "--cores", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.rmtree(workdir / ".snakemake" / "aqflow", ignore_errors=True)  # --touch planned (and hashed) once
    rows = []
    for label, src in (("with the check, cold (no digest cache)", REPO), ("with the check, warm", REPO),
                       ("with the check, warm again", REPO)) + ((("without the check", args.baseline_src),)
                                                               if args.baseline_src else ()):
        seconds, result = snakemake(src, workdir, config_path, "-n")
        assert result.returncode == 0 and "Nothing to be done" in result.stdout + result.stderr, result.stderr[-3000:]
        rows.append((label, seconds))
    print(f"tree: {size / 1e9:.1f} GB in {sum(1 for p in workdir.rglob('*') if p.is_file())} files, written in "
          f"{written:.0f} s; {len(layer_names())} layers, {BLOCKS} XᵀX NPZ")
    print("| `snakemake -n` on the finished 3B-sized run | seconds |\n|---|---|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.1f} |")
    if not args.keep:
        shutil.rmtree(workdir)
        shutil.rmtree(source)


def validated(config_path: Path) -> dict:
    """The config as Snakemake validates it (schema defaults filled in), for the plan's paths."""
    from snakemake.utils import validate

    config = yaml.safe_load(config_path.read_text())
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


if __name__ == "__main__":
    main()
