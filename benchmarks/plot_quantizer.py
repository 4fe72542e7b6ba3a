"""Plot a quantizer_gpu.py result: seconds per layer and final output error, ours vs the reference.

    python benchmarks/plot_quantizer.py benchmarks/results/quantizer_gpu_h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> None:
    results = json.loads(Path(path).read_text())
    reference = {(r["bpp"], r["layer"]): r for r in results["reference_full"]}
    ours = {(r["bpp"], r["init"], r["layer"]): r for r in results["runs"]}
    rates = sorted({b for b, _ in reference})
    fig, axes = plt.subplots(2, len(rates), figsize=(7 * len(rates), 8), squeeze=False)
    for col, bpp in enumerate(rates):
        names = [n for b, n in reference if b == bpp]
        x = range(len(names))
        top, bottom = axes[0][col], axes[1][col]
        top.bar([i - 0.27 for i in x], [reference[(bpp, n)]["reference_seconds"] for n in names], 0.27, label="AQLM reference (greedy)")
        for shift, init in ((0.0, "greedy"), (0.27, "oaem")):
            top.bar([i + shift for i in x], [ours[(bpp, init, n)]["total_seconds"] for n in names], 0.27, label=f"aqflow {init}")
        top.set_yscale("log")
        top.set_ylabel("seconds per layer (log)")
        top.set_title(f"{bpp} bpp, beam 8, ≤100 epochs, 1% tolerance — {results['device']}")
        top.set_xticks(list(x), [n.replace("self_attn.", "").replace("mlp.", "") for n in names], rotation=90, fontsize=7)
        top.legend(fontsize=8)
        ref_err = [reference[(bpp, n)]["reference_final_relative_mse"] for n in names]
        for init, marker in (("greedy", "o"), ("oaem", "x")):
            bottom.scatter(ref_err, [ours[(bpp, init, n)]["final_relative_mse"] for n in names], marker=marker, label=f"aqflow {init}")
        lo, hi = min(ref_err) * 0.8, max(ref_err) * 1.2
        bottom.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="equal error")
        bottom.set_xscale("log")
        bottom.set_yscale("log")
        bottom.set_xlabel("reference final relative output MSE")
        bottom.set_ylabel("aqflow final relative output MSE")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
