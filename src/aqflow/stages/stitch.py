"""`python -m aqflow stitch`: per-layer AQLM results + the full-precision model -> one AQLM checkpoint.

Reads the model folder and one `<module name>.safetensors` per quantized linear from the layers
folder, and writes a standard AQLM Hugging Face folder (config with `quantization_config`,
safetensors weights, tokenizer) that `transformers` + `aqlm` load with `from_pretrained`. Every
artifact is checked before anything is written; on a bad input nothing is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aqflow.checkpoint import CheckpointError, write_aqlm_checkpoint
from aqflow.models.folder import stored_bits_per_parameter
from aqflow.models.fetch import config_dtype
from aqflow.artifacts import load_safetensors, verify_inputs
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow stitch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path, help="full-precision Hugging Face model folder")
    parser.add_argument("--layers-dir", required=True, type=Path, nargs="+",
                        help="folder(s) of <module name>.safetensors layer results; each layer in exactly one")
    parser.add_argument("--replace-tensors", type=Path, nargs="*", default=[],
                        help="safetensors files of tuned full-precision tensors (block fine-tuning's "
                             "block.safetensors) stored instead of the model's")
    parser.add_argument("--output-dir", required=True, type=Path, help="checkpoint folder to create (must not exist)")
    parser.add_argument("--num-codebooks", required=True, type=int)
    parser.add_argument("--nbits", required=True, type=int, help="bits per code (codebooks of 2^nbits codewords)")
    parser.add_argument("--group-size", type=int, default=8, help="input weights per group")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"),
                        help="dtype of codebooks, scales and the full-precision tensors (auto: the model folder's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        dtype = (config_dtype(args.model_dir) or "float16") if args.dtype == "auto" else args.dtype
        verify_inputs(args.model_dir, *args.layers_dir, *args.replace_tensors)
        replaced = {}
        for path in args.replace_tensors:
            replaced.update(load_safetensors(path, verify=False))  # verified above
        output_dir = write_aqlm_checkpoint(args.model_dir, args.layers_dir, args.output_dir,
                                           num_codebooks=args.num_codebooks, nbits=args.nbits,
                                           group_size=args.group_size, dtype=dtype, replaced_tensors=replaced)
    except (*EXPECTED_ERRORS, CheckpointError, ValueError, KeyError) as error:
        return report_error("stitch", error)
    print(f"{output_dir}: AQLM checkpoint, {stored_bits_per_parameter(output_dir)['bits_per_parameter']:.3f} stored bits per quantized weight")
    return 0
