"""Where one layer's time goes on the GPU: CUDA kernels of an Adam step, a beam-search pass and
a k-means run, from torch.profiler (eager, no graphs), plus graph-replayed wall times.

    PYTHONPATH=src python3 benchmarks/profile_phases.py --bundle .device-carry/smollm2-layers/block15.safetensors \
        --linear mlp.gate_proj
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from aqflow.quant.beam_search import BeamSearcher, beam_search_rows
from aqflow.quant.codebook_update import CodebookAdam
from aqflow.quant.kmeans import fit_kmeans
from aqflow.quant.quantize import QuantizerSettings, quantize_layer
from benchmarks.quantizer_gpu import load_bundle


def timed(fn, repeat=5):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def top_kernels(fn, label, rows=12):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n== {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--linear", default="mlp.gate_proj")
    parser.add_argument("--bpp", type=int, default=2)
    args = parser.parse_args()
    layer = next(l for l in load_bundle(args.bundle) if l["name"].endswith(args.linear))
    settings = QuantizerSettings(num_codebooks=args.bpp, init="greedy", max_epochs=0)
    quantized, _ = quantize_layer(layer["weight"], layer["xtx"], settings, device="cuda", progress=False)
    w, h = layer["weight"].cuda(), layer["xtx"].cuda()
    codes, codebooks, scales = quantized.codes.cuda(), quantized.codebooks[:, :, 0].cuda(), quantized.scales.flatten().cuda()
    eager_adam = CodebookAdam(w, h, codebooks, scales, 1e-4)
    top_kernels(lambda: eager_adam.run(codes, 10), "10 Adam steps (eager)")
    top_kernels(lambda: beam_search_rows(w, h, codebooks, scales, codes, 8), "one beam pass (eager, Triton stages)")
    points = (w / w.norm(dim=1, keepdim=True)).reshape(-1, 8)
    top_kernels(lambda: fit_kmeans(points, 256, 100, torch.Generator().manual_seed(0)), "k-means, 100 iterations")
    graphed_adam = CodebookAdam.for_layer(w, h, codebooks, scales, 1e-4)
    searcher = BeamSearcher(h, 8, 2 << 30)
    print(f"\nreplayed: 100 Adam steps {timed(lambda: graphed_adam.run(codes, 100)) * 1e3:.2f} ms, "
          f"beam pass {timed(lambda: searcher(w, codebooks, scales, codes)) * 1e3:.2f} ms, "
          f"beam pass torch stages (eager) {timed(lambda: beam_search_rows(w, h, codebooks, scales, codes, 8, use_triton=False), 2) * 1e3:.1f} ms, "
          f"k-means 1000 it max {timed(lambda: fit_kmeans(points, 256, 1000, torch.Generator().manual_seed(0)), 2) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
