"""Where a 2-bit GEMV's time goes inside a decode step (issue 27): per CTA of every split-K launch, the
time of each phase, from stamps the kernel itself takes.

Needs the extension built from a copy with `benchmarks/patches/gemv_timeline.patch` applied (its
binding gains `timeline()`): thread 0 of every CTA stamps the SM clock and the global timer at kernel
entry, after requesting its first codes and loading the codebooks, when the PDL wait returns, when
the first input word arrives, then its first codebook word, when the tables are built (after the
barrier), after the first batch of rows and at the end (after a last barrier), and appends a record to a
ring of 131,072.
`benchmarks/gemv_timeline_check.sh` applies the patch to a copy and runs this (results in OUT_DIR/t_m/).
On a copy without the patch it reports only each shape's decode speed (benchmarks/variant_speeds.sh times
variants so). (The results of session 30, results/gemv_timeline_h200/, code_layout_h200/ and
code_loads_h200/, came from its first form, without the codebook stamp: their build includes the wait for
the codebooks.)

A Llama of each shape with random 2x8 codes decodes through `greedy_decode` (compile + graph, open sums,
PDL: the decode as benchmarked), the GEMVs on the configurations of `--configs` (an inference_gpu.json's
`tuned_configs`; else each shape's default). The last step's launches are read back, and per linear
(q/k/v, o, gate/up, down) the script prints the medians over the step's layers of:

- exposed: from the PDL wait's return (the kernel before is done) to the launch's last CTA end, the
  part of the step the GEMV holds alone;
- the CTA phases: request (codes requested, codebooks loaded), wait (PDL), x (the first input word's
  latency after the wait), codebooks (then its first codebook word's), build (tables and barrier),
  batch1 (the first batch of rows' look-ups), rest (later batches, the sums' additions, the last barrier);
- late: CTAs that started after the launch's first CTA had ended (a second wave).

    python benchmarks/gemv_timeline.py --shapes 3b,8b --configs CONFIGS.json --out OUT_DIR
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_gpu import SHAPES, build_llama, quantize_randomly  # noqa: E402
from lut_kernel_profile import parse_label  # noqa: E402

from aqflow.inference import cuda_kernels  # noqa: E402
from aqflow.inference import gpu_kernels as gk  # noqa: E402
from aqflow.inference.decode import fuse_projections, greedy_decode  # noqa: E402

STAMPS = ("entry", "request", "wait", "x", "codebooks", "build", "batch1", "end")
PHASES = ("request", "wait", "x", "codebooks", "build", "batch1", "rest")  # each from the stamp before it to its own
END = len(STAMPS) - 1
LAUNCH_GAP_NS = 100_000  # a linear's launches in successive steps lie ~1 ms apart


def records_of(raw: torch.Tensor, count: int) -> list[dict]:
    """raw [N, 16] int64 as the binding returns it -> the written records, oldest first by entry time. A
    record: codes address, where, len(STAMPS) global-timer stamps, then 32-bit words: the clock stamps, rows."""
    n = min(count, raw.shape[0])
    rows = raw[:n].tolist()
    found = []
    first_word = 2 + len(STAMPS)
    for r in rows:
        where = r[1] & 0xFFFFFFFFFFFFFFFF
        cycles = []
        for word in r[first_word:16]:
            word &= 0xFFFFFFFFFFFFFFFF
            cycles += [word & 0xFFFFFFFF, word >> 32]
        found.append({"codes": r[0], "block": where & 0xFFFF, "split": (where >> 16) & 0xFFFF,
                      "sm": (where >> 32) & 0xFFFF, "splits": where >> 48, "ns": r[2:first_word],
                      "cycles": cycles[:len(STAMPS)], "rows": cycles[len(STAMPS)]})
    return sorted(found, key=lambda rec: rec["ns"][0])


def launches_of(records: list[dict]) -> list[list[dict]]:
    """The records grouped into launches (one linear's CTAs close in time), ordered by first entry."""
    by_codes: dict[int, list[dict]] = {}
    for rec in records:
        by_codes.setdefault(rec["codes"], []).append(rec)
    launches = []
    for recs in by_codes.values():
        current = [recs[0]]
        for rec in recs[1:]:
            if rec["ns"][0] - current[-1]["ns"][0] > LAUNCH_GAP_NS:
                launches.append(current)
                current = []
            current.append(rec)
        launches.append(current)
    return sorted(launches, key=lambda launch: launch[0]["ns"][0])


def cycle_span(rec: dict, a: int, b: int) -> int:
    """SM cycles from stamp a to stamp b of one CTA (32-bit clock, wraps)."""
    return (rec["cycles"][b] - rec["cycles"][a]) & 0xFFFFFFFF


def launch_summary(launch: list[dict], ghz: float) -> dict:
    """One launch: its CTAs, exposed time and per-phase medians (microseconds)."""
    first_end = min(rec["ns"][END] for rec in launch)
    wait_over = statistics.median(rec["ns"][2] for rec in launch)
    phases = {name: [cycle_span(rec, k, k + 1) / ghz / 1e3 for rec in launch] for k, name in enumerate(PHASES)}
    return {
        "ctas": len(launch), "rows": sum(rec["rows"] for rec in launch if rec["split"] == 0),
        "splits": launch[0]["splits"],
        "exposed_us": (max(rec["ns"][END] for rec in launch) - wait_over) / 1e3,
        "span_us": (max(rec["ns"][END] for rec in launch) - min(rec["ns"][0] for rec in launch)) / 1e3,
        "late_ctas": sum(rec["ns"][0] > first_end for rec in launch),
        "phase_median_us": {name: statistics.median(v) for name, v in phases.items()},
        "phase_max_us": {name: max(v) for name, v in phases.items()},
        "cta_us_median": statistics.median(cycle_span(rec, 0, END) for rec in launch) / ghz / 1e3,
    }


def clock_ghz(records: list[dict]) -> float:
    """SM clock: cycles over nanoseconds, entry to end, summed over the CTAs."""
    cycles = sum(cycle_span(rec, 0, END) for rec in records)
    ns = sum(rec["ns"][END] - rec["ns"][0] for rec in records)
    return cycles / ns


def kinds_of(step: list[dict], hidden: int) -> list[str]:
    """Each launch's linear, from its rows: o and down both have `hidden` rows; o follows q/k/v."""
    names, previous = [], None
    for launch in step:
        rows = launch["rows"]
        if rows == hidden:
            name = "o" if previous == "qkv" else "down"
        elif rows > 3 * hidden:
            name = "gate+up"
        else:
            name = "qkv"
        names.append(name)
        previous = name
    return names


def set_configs(path: str | None) -> dict:
    """Records the tuned configurations of an inference_gpu.json; returns them (shape key -> label)."""
    if not path:
        return {}
    configs = json.loads(Path(path).read_text()).get("tuned_configs") or {}
    for key, label in configs.items():
        gk.set_tuned(ast.literal_eval(key), parse_label(label))
    return configs


def timeline_shape(shape_name: str, args) -> dict:
    device = torch.device("cuda")
    model = build_llama(shape_name, device, torch.bfloat16)
    quantize_randomly(model, "ours")
    fuse_projections(model)
    layers = model.config.num_hidden_layers
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(7))
    _, timings = greedy_decode(model, prompt, args.new_tokens, graphs=True, compile=True, fuse=False)
    torch.cuda.synchronize()
    speed = {"decode_tokens_per_second": timings.decode_tokens_per_second, "mode": timings.mode,
             "open_sums": timings.open_sums}
    extension = cuda_kernels.load_extension()
    if not hasattr(extension, "timeline"):  # a copy without the patch: the decode's speed alone
        del model
        torch.cuda.empty_cache()
        return speed
    raw, count = extension.timeline()
    records = records_of(raw, count)
    ghz = clock_ghz(records[-20000:])
    launches = launches_of(records)
    step = [launch_summary(launch, ghz) for launch in launches[-4 * layers:]]
    for launch, kind in zip(step, kinds_of(step, model.config.hidden_size)):
        launch["linear"] = kind
    summary = {}
    for kind in ("qkv", "o", "gate+up", "down"):
        mine = [launch for launch in step if launch["linear"] == kind]
        if not mine:
            continue
        summary[kind] = {
            "launches": len(mine), "ctas": mine[0]["ctas"], "splits": mine[0]["splits"],
            "exposed_us": statistics.median(m["exposed_us"] for m in mine),
            "span_us": statistics.median(m["span_us"] for m in mine),
            "cta_us": statistics.median(m["cta_us_median"] for m in mine),
            "late_ctas": statistics.median(m["late_ctas"] for m in mine),
            "phase_median_us": {p: statistics.median(m["phase_median_us"][p] for m in mine) for p in PHASES},
            "phase_max_us": {p: statistics.median(m["phase_max_us"][p] for m in mine) for p in PHASES},
        }
    del model
    torch.cuda.empty_cache()
    return {**speed, "records_written": count, "clock_ghz": ghz,
            "step_exposed_us": sum(m["exposed_us"] for m in step), "step_launches": len(step),
            "summary": summary, "last_step": step}


def table(name: str, result: dict) -> list[str]:
    if "summary" not in result:  # no timeline (unpatched)
        return [f"{name}: {result['decode_tokens_per_second']:.1f} tok/s ({result['mode']}), no timeline"]
    lines = [f"{name}: {result['decode_tokens_per_second']:.1f} tok/s ({result['mode']}), SM clock "
             f"{result['clock_ghz']:.2f} GHz, GEMVs exposed {result['step_exposed_us']:.0f} us a step "
             f"({result['step_launches']} launches)",
             f"{'linear':8s} {'CTAs':>5s} {'exposed':>8s} {'CTA':>6s} " + " ".join(f"{p:>7s}" for p in PHASES)
             + f" {'late':>5s}  (us; phase medians over CTAs, then layers; max per phase below)"]
    for kind, s in result["summary"].items():
        lines.append(f"{kind:8s} {s['ctas']:5d} {s['exposed_us']:8.2f} {s['cta_us']:6.2f} "
                     + " ".join(f"{s['phase_median_us'][p]:7.2f}" for p in PHASES) + f" {s['late_ctas']:5.0f}")
        lines.append(f"{'':8s} {'':5s} {'':8s} {'max':>6s} " + " ".join(f"{s['phase_max_us'][p]:7.2f}" for p in PHASES))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="3b,8b")
    parser.add_argument("--configs", help="an inference_gpu.json whose tuned_configs the GEMVs run")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    start = time.perf_counter()
    cuda_kernels.load_extension()
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "configs": set_configs(args.configs), "build_seconds": time.perf_counter() - start, "shapes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}: {', '.join(SHAPES)}")
        payload["shapes"][name] = timeline_shape(name, args)
        (out / "gemv_timeline.json").write_text(json.dumps(payload, indent=1))
        print("\n".join(table(name, payload["shapes"][name])), flush=True)
    print(f"wrote {out / 'gemv_timeline.json'}")


if __name__ == "__main__":
    main()
