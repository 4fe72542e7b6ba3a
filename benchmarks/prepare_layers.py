"""Prepare real layers of an offline preset for benchmarking the quantizer on a device machine.

Fetches and converts the preset (SmolLM2 by default; any offline preset, e.g. qwen2.5-coder-1.5b),
samples calibration windows from the calibration role of the C4 stand-in, computes XᵀX (fp mode)
for a few blocks and writes one safetensors file per block, small enough to carry to a GPU machine
(`--linears` leaves out linears, e.g. a wide down_proj whose XᵀX alone is hundreds of MB):

    {linear}.weight      float16 [out, in]         for the 7 linears of the block
    {site}.xtx_triu      float32 [n (n + 1) / 2]   upper triangle of XᵀX, torch.triu_indices(n, n) order
    metadata (strings):  linear_to_site (JSON), site_sizes (JSON, n per site), tokens (JSON), block, ...

Rebuild XᵀX with:  iu = torch.triu_indices(n, n); H = zeros(n, n); H[iu[0], iu[1]] = t; H = H + H.T - diag(diag(H))

Usage: python benchmarks/prepare_layers.py [OUT_DIR] [--preset smollm2] [--blocks 0 15 29] [--linears q_proj ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from aqflow.io.artifacts import save_safetensors, write_json, write_parquet
from aqflow.calibration import collect_xtx_fp
from aqflow.data import prepare_corpus, role_texts, sample_calibration_windows
from aqflow.io.fetching import default_cache_dir
from aqflow.models import find_decoder_blocks, find_linears, load_causal_lm, load_tokenizer, prepare_model


def pack_upper_triangle(xtx: torch.Tensor) -> torch.Tensor:
    """xtx: [n, n] symmetric -> [n (n + 1) / 2] float32, rows of the upper triangle (diagonal included)."""
    n = xtx.shape[0]
    rows, cols = torch.triu_indices(n, n)
    return xtx[rows, cols].to(torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=".device-carry/smollm2-layers")
    parser.add_argument("--cache-dir", default=None, help="download cache (default: $AQFLOW_CACHE or resources/cache)")
    parser.add_argument("--preset", default="smollm2", help="offline model preset (models/presets.py)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 15, 29])
    parser.add_argument("--linears", nargs="+", default=None,
                        help="substrings naming the linears to keep (default: every linear of the block)")
    parser.add_argument("--num-windows", type=int, default=64)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration-fraction", type=float, default=0.5)
    args = parser.parse_args()

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    out_dir = Path(args.out_dir)

    started = time.perf_counter()
    folder = prepare_model(args.preset, cache_dir)
    model = load_causal_lm(folder, dtype="float32")
    tokenizer = load_tokenizer(folder)
    split = prepare_corpus("c4-standin", cache_dir, cache_dir / "corpora" / "c4-standin.parquet",
                           args.calibration_fraction, args.seed)
    doc_ids, texts = role_texts(split, "calibration")
    windows = sample_calibration_windows(doc_ids, texts, tokenizer, args.num_windows, args.window_tokens, args.seed)
    prepare_seconds = time.perf_counter() - started
    source_data_id = (f"c4-standin/calibration/frac{args.calibration_fraction}/seed{args.seed}/"
                      f"{args.num_windows}x{args.window_tokens}")

    started = time.perf_counter()
    stats = collect_xtx_fp(model, windows.input_ids, args.blocks, batch_size=args.batch_size)
    xtx_seconds = time.perf_counter() - started
    print(f"XᵀX of blocks {args.blocks} on {args.num_windows} x {args.window_tokens} tokens: "
          f"{xtx_seconds:.1f} s ({torch.get_num_threads()} threads)")

    _, blocks = find_decoder_blocks(model)
    sizes_bytes = {}
    for i, block_stats in stats.items():
        kept = {name: linear for name, linear in find_linears(blocks[i]).items()
                if args.linears is None or any(part in name for part in args.linears)}
        tensors = {f"{name}.weight": linear.weight.detach().to(torch.float16) for name, linear in kept.items()}
        kept_sites = [s for s in block_stats.sites if any(lin in kept for lin in s.linears)]
        for site in kept_sites:
            tensors[f"{site.site_id}.xtx_triu"] = pack_upper_triangle(block_stats.xtx[site.site_id])
        metadata = {
            "model": args.preset,
            "block": str(i),
            "linear_to_site": json.dumps({lin: s.site_id for s in kept_sites for lin in s.linears if lin in kept}),
            "site_sizes": json.dumps({s.site_id: s.in_features for s in kept_sites}),
            "tokens": json.dumps(block_stats.tokens),
            "xtx_triu_order": "torch.triu_indices(n, n): upper triangle row by row, diagonal included",
            "source_data_id": source_data_id,
            "note": f"weights dequantized from the GGUF of the {args.preset} preset (the source model)",
        }
        path = out_dir / f"block{i}.safetensors"
        save_safetensors(path, tensors, metadata)
        sizes_bytes[path.name] = path.stat().st_size
        print(f"{path}: {sizes_bytes[path.name] / 1e6:.2f} MB")

    write_parquet(out_dir / "calibration_windows.parquet", windows.to_frame())
    write_json(out_dir / "summary.json", {
        "preset": args.preset, "blocks": args.blocks, "num_windows": args.num_windows, "window_tokens": args.window_tokens,
        "source_data_id": source_data_id, "prepare_seconds": prepare_seconds, "xtx_seconds": xtx_seconds,
        "torch_threads": torch.get_num_threads(), "sizes_bytes": sizes_bytes,
        "total_bytes": sum(sizes_bytes.values()),
    })
    print(f"total {sum(sizes_bytes.values()) / 1e6:.2f} MB in {out_dir}")


if __name__ == "__main__":
    main()
