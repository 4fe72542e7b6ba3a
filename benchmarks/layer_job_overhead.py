"""The fixed cost of one `quantize_layer` job outside its quantization, per phase, before and after.

    PYTHONPATH=src AQFLOW_CACHE=... python3 benchmarks/layer_job_overhead.py --before 1398ade \\
        --machine "2-core CPU, no GPU" --json benchmarks/results/layer_job_overhead_cpu.json
    # on a GPU box: add --device cuda (the card's name is taken from the job's metrics)

Inputs, built once under --work: a SmolLM2 model folder as the pipeline's fetch-model writes it
(from the local Hugging Face folder --source, default $AQFLOW_CACHE/smollm2/hf-float16; or give
an existing one with --model-dir) and a calibration folder for the layer's block in `calibrate`'s
layout, with dense random XᵀX (real XᵀX is incompressible too). Both source trees read the same
folders.

Each tree (before: `git archive <--before> src` of this repository; after: this checkout's src)
runs --repeats fresh processes (after one unmeasured warm-up that fills the page cache), each one
job as the rule script runs it: the imports of Snakemake's script preamble, then `run_stage` with
the rule's snakemake object and the layer's settings, its quantization made negligible (one
epoch of one Adam step, beam 1, two k-means iterations). Phases are timed from inside (wrappers
around the named functions, where a tree has them) and from the parent (process start until the
script's first line; interpreter exit after the last). `fixed` = the process's wall time minus
the quantization's. CPU seconds are the process's and its children's (user + system).
--snakemake: also the block's linears as jobs of a one-rule Snakemake workflow with the
pipeline's rule script (workflow/scripts/quantize_layer.py), one at a time, timed by Snakemake's
benchmark files as the pipeline's jobs are.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICK_QUANTIZER = {"max_epochs": 1, "steps_per_epoch": 1, "beam_size": 1, "oaem_rounds": 1, "oaem_steps": 1,
                   "kmeans_max_iter": 2}
# (module, function, phase label): wrapped in the child where the tree has them
TIMED = (
    ("aqflow.jobs.gpu_pool", "pin_job_gpus", "pin the job's GPU (nvidia-smi)"),
    ("aqflow.jobs.stage_jobs", "stage_call", "settings and paths (CUDA check)"),
    ("aqflow.jobs.stage_jobs", "remove_stale_outputs", "stale-output cleanup"),
    ("aqflow.jobs.workflow_glue", "stage_call", "settings and paths (CUDA check)"),  # trees before stage_jobs
    ("aqflow.jobs.workflow_glue", "remove_stale_outputs", "stale-output cleanup"),
    ("aqflow.stages.quantize_layer", "load_inputs", "read inputs"),
    ("aqflow.stages.quantize_layer", "calibration_site", "  find the XᵀX site (manifest)"),
    ("aqflow.models.folder", "read_tensor", "  read the weight (model shard)"),
    ("aqflow.io.artifacts", "file_sha256", "  of which whole-file sha256"),
    ("aqflow.quant.quantize", "quantize_layer", "quantization"),
    ("aqflow.stages.quantize_layer", "write_layer_pair", "write the layer pair"),
)
ORDER = ["process start", "snakemake preamble imports", "import aqflow.jobs.workflow_glue",
         "import the stage (torch, triton, ...)", "pin the job's GPU (nvidia-smi)", "settings and paths (CUDA check)",
         "stale-output cleanup", "read inputs", "  find the XᵀX site (manifest)", "  read the weight (model shard)",
         "  read the XᵀX array", "  of which whole-file sha256", "CUDA context", "quantization",
         "  of which first use of the card's kernels", "write the layer pair", "rest of run_stage", "interpreter exit"]
assert {label for _, _, label in TIMED} <= set(ORDER)


# --- the child: one job -------------------------------------------------------------------------

def child(args) -> None:
    first_line = time.time()
    phases: dict[str, float] = {}

    def timed(label, load):
        start = time.perf_counter()
        result = load()
        phases[label] = phases.get(label, 0.0) + time.perf_counter() - start
        return result

    import importlib

    timed("snakemake preamble imports", lambda: [importlib.import_module(name) for name in
                                                 ("snakemake.io", "snakemake.logging", "snakemake.iocontainers")])
    glue = timed("import aqflow.jobs.workflow_glue", lambda: importlib.import_module("aqflow.jobs.workflow_glue"))
    timed("import the stage (torch, triton, ...)", lambda: importlib.import_module("aqflow.stages.quantize_layer"))
    for module_name, function_name, label in TIMED:
        wrap_everywhere(module_name, function_name, label, phases, cuda=args.device.startswith("cuda"))
    out = Path(args.out)
    snakemake = _namespace(resources=_namespace(gpu=1 if args.device.startswith("cuda") else 0),
                           log=[str(out / "job.log")], output=[str(out / "layer.safetensors"), str(out / "layer.json")])
    start = time.perf_counter()
    glue.run_stage(snakemake, "quantize-layer", settings={"quantizer": QUICK_QUANTIZER, "device": args.device},
                   paths={"model_dir": args.model_dir, "calibration_dir": args.calibration_dir, "layer": args.layer,
                          "output": str(out / "layer.safetensors"), "metrics": str(out / "layer.json")})
    run_stage = time.perf_counter() - start
    inside = sum(phases.get(label, 0.0) for label in {label for _, _, label in TIMED} if not label.startswith("  ")) \
        + phases.get("CUDA context", 0.0)
    phases["rest of run_stage"] = run_stage - inside
    phases["  read the XᵀX array"] = phases.get("read inputs", 0.0) - phases.get("  find the XᵀX site (manifest)", 0.0) \
        - phases.get("  read the weight (model shard)", 0.0)
    warm = warm_quantization_seconds(args.device.startswith("cuda"))
    if warm is not None:  # the quantization's first-use cost: kernel loads, graph captures, library set-up
        phases["  of which first use of the card's kernels"] = phases.get("quantization", 0.0) - warm
    metrics = json.loads((out / "layer.json").read_text())
    print(json.dumps({"phases": phases, "first_line": first_line, "last_line": time.time(),
                      "quantizer_total_seconds": metrics["total_seconds"], "device_name": metrics["device"]}))
    sys.stdout.flush()


CALLS: dict = {}  # function name -> (function, args, kwargs) of its last call in the child


def warm_quantization_seconds(cuda: bool) -> float | None:
    """The job's quantization called again in the same process: what it costs once the card's
    kernels are loaded, its CUDA graphs captured and its libraries set up (GPU only)."""
    if not cuda or "quantize_layer" not in CALLS:
        return None
    import torch

    function, args, kwargs = CALLS["quantize_layer"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    function(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


class _namespace:
    def __init__(self, **values):
        self.__dict__.update(values)


def wrap_everywhere(module_name: str, function_name: str, label: str, phases: dict, cuda: bool) -> None:
    """Replace `module.function` by a timing wrapper in every loaded module that holds it (those
    that imported it by name too); nothing if the tree has no such function."""
    module = sys.modules.get(module_name)
    original = getattr(module, function_name, None)
    if original is None or getattr(original, "timed", False):
        return

    def wrapper(*args, **kwargs):
        if function_name == "quantize_layer":  # kept for the second, warm call (warm_quantization_seconds)
            CALLS[function_name] = (original, args, kwargs)
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        finally:
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - start
        if cuda and function_name == "stage_call":  # the CUDA context, apart from the quantization's time
            import torch

            begin = time.perf_counter()
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            phases["CUDA context"] = time.perf_counter() - begin
        return result

    wrapper.timed = True
    for holder in list(sys.modules.values()):
        if getattr(holder, function_name, None) is original:
            setattr(holder, function_name, wrapper)


# --- the parent: inputs, processes, summary ------------------------------------------------------

def build_inputs(args) -> tuple[Path, Path]:
    """(model folder, calibration folder) under args.work, built with this checkout's aqflow."""
    sys.path.insert(0, str(REPO / "src"))
    import torch

    from aqflow.io import artifacts
    from aqflow.calibration.hessians import BlockXtx, discover_input_sites, save_block_xtx
    from aqflow.models.fetch import load_causal_lm, prepare_local_model
    from aqflow.models.folder import split_module_name

    work = Path(args.work)
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    if not model_dir.exists():
        prepare_local_model(args.source, model_dir)
    block, _ = split_module_name(args.layer)
    calibration_dir = work / f"calibration-block{block}"
    if not calibration_dir.exists():
        model = load_causal_lm(model_dir)
        sites = discover_input_sites(model, torch.zeros(1, 8, dtype=torch.long), [block])[block]
        generator = torch.Generator().manual_seed(0)
        stats = BlockXtx(block=block, sites=sites)
        for site in sites:
            x = torch.randn(2 * site.in_features, site.in_features, generator=generator, dtype=torch.float64)
            stats.xtx[site.site_id], stats.tokens[site.site_id] = x.T @ x, x.shape[0]
        with artifacts.atomic_dir(calibration_dir) as staging:
            save_block_xtx(staging, {block: stats}, "synthetic dense XᵀX")
    return model_dir, calibration_dir


def source_tree(commit: str, work: Path) -> Path:
    """`git archive <commit> src` of this repository, unpacked under `work` (once)."""
    tree = work / f"src-{commit}"
    if not (tree / "src").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def child_pythonpath(tree: Path) -> str:
    """The tree's src, then $SITE if set (the GPU box's staged packages, as for eval_speed.py)."""
    return os.pathsep.join([str(tree / "src"), *filter(None, [os.environ.get("SITE")])])


def one_job(tree: Path, args, model_dir: Path, calibration_dir: Path, out: Path) -> dict:
    """One child process on `tree`: its phases, wall and CPU seconds."""
    out.mkdir(parents=True, exist_ok=True)
    # one pool folder per tree, as one per working folder in the pipeline (its card listing is kept there)
    env = dict(os.environ, PYTHONPATH=child_pythonpath(tree), AQFLOW_GPU_POOL_DIR=str(out.parent / f"gpu-pool-{tree.name}"))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--device", args.device, "--layer", args.layer,
               "--model-dir", str(model_dir), "--calibration-dir", str(calibration_dir), "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=out)
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"the job failed ({tree}):\n{done.stderr[-3000:]}\n{(out / 'job.log').read_text()[-2000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    phases = record["phases"] | {"process start": record["first_line"] - spawned, "interpreter exit": ended - record["last_line"]}
    wall = ended - spawned
    return {"phases": phases, "wall_seconds": wall,
            "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "quantization_seconds": phases.get("quantization", 0.0),
            "quantizer_total_seconds": record["quantizer_total_seconds"],
            "fixed_seconds": wall - phases.get("quantization", 0.0), "device_name": record["device_name"]}


SNAKEFILE = """
from types import SimpleNamespace

# what the pipeline's rule gets from its plan (aqflow.jobs.plan.Execution): the warm-worker settings
EXECUTION = SimpleNamespace(warm_workers=config.get("execution", {{}}).get("warm_workers", False),
                            warm_worker_idle_seconds=config.get("execution", {{}}).get("warm_worker_idle_seconds", 20))

rule quantize_layer:
    input: model={model!r}, calibration={calibration!r}
    output: layer="out/{{layer}}.safetensors", metrics="out/{{layer}}.json"
    log: "logs/{{layer}}.log"
    benchmark: "benchmarks/{{layer}}.tsv"
    resources: gpu={gpu}
    params: settings={settings!r}, execution=EXECUTION
    script: {script!r}
"""


def snakemake_jobs(tree: Path, args, model_dir: Path, calibration_dir: Path, folder: Path, warm: bool = False) -> dict:
    """The block's linears as Snakemake jobs (one at a time) of a one-rule workflow with the
    pipeline's rule script: per job, the wall and CPU seconds Snakemake's benchmark file records."""
    sys.path.insert(0, str(REPO / "src"))
    from aqflow.calibration.site_xtx import manifest_rows
    from aqflow.models.folder import split_module_name

    block, _ = split_module_name(args.layer)
    prefix = args.layer[: args.layer.index(f".{block}.") + len(f".{block}.")]
    linears = [prefix + linear for row in manifest_rows(calibration_dir) if row["block"] == block for linear in row["linears"]]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "Snakefile").write_text(SNAKEFILE.format(
        model=str(model_dir), calibration=str(calibration_dir), gpu=int(args.device.startswith("cuda")),
        settings=QUICK_QUANTIZER, script=str(REPO / "workflow" / "scripts" / "quantize_layer.py")))
    env = dict(os.environ, PYTHONPATH=child_pythonpath(tree), AQFLOW_GPU_POOL_DIR=str(folder / "gpu-pool"))
    command = [sys.executable, "-m", "snakemake", "-s", "Snakefile", *[f"out/{name}.safetensors" for name in linears],
               "--cores", "1", "--resources", "gpu=1", "--quiet", "all",
               *(["--configfile", "execution.yaml"] if warm else [])]
    if warm:  # a file, not --config: Snakemake reads nested --config values as strings
        (folder / "execution.yaml").write_text("execution:\n  warm_workers: true\n  warm_worker_idle_seconds: 20\n")
    started = time.time()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"snakemake failed ({tree}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    jobs = []
    for name in linears:
        header, values = (folder / "benchmarks" / f"{name}.tsv").read_text().splitlines()[:2]
        row = dict(zip(header.split("\t"), values.split("\t")))
        quantization = json.loads((folder / "out" / f"{name}.json").read_text())["total_seconds"]
        jobs.append({"layer": name, "wall_seconds": float(row["s"]), "cpu_seconds": float(row["cpu_time"]),
                     "quantizer_total_seconds": quantization})
    return {"block": block, "jobs": jobs, "snakemake_seconds": time.time() - started,
            **{f"{key}_median": statistics.median(job[key] for job in jobs)
               for key in ("wall_seconds", "cpu_seconds", "quantizer_total_seconds")}}


def shown_arguments(argv: list[str]) -> list[str]:
    """The command line as recorded: the scratch folder (a path of the machine) as <work>."""
    return ["<work>" if index and argv[index - 1] == "--work" else value for index, value in enumerate(argv)]


def summarize(runs: list[dict]) -> dict:
    labels = {label for run in runs for label in run["phases"]}
    return {"phases_median": {label: statistics.median(run["phases"].get(label, 0.0) for run in runs)
                              for label in ORDER if label in labels},
            **{f"{key}_median": statistics.median(run[key] for run in runs)
               for key in ("wall_seconds", "cpu_seconds", "quantization_seconds", "fixed_seconds")}}


def table(report: dict) -> str:
    labels = list(report["trees"])
    lines = [f"{report['layer']} on {report['machine']} ({report['device']}), median of {report['repeats']} jobs, seconds",
             f"{'phase':<40}" + "".join(f"{label:>10}" for label in labels)]
    phase_names = [label for label in ORDER if any(label in tree["phases_median"] for tree in report["trees"].values())]
    for label in phase_names:
        lines.append(f"{label:<40}" + "".join(f"{tree['phases_median'].get(label, 0.0):>10.3f}" for tree in report["trees"].values()))
    for key in ("wall_seconds", "cpu_seconds", "quantization_seconds", "fixed_seconds"):
        lines.append(f"{'job ' + key.replace('_seconds', ''):<40}" + "".join(f"{tree[key + '_median']:>10.3f}" for tree in report["trees"].values()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="commit whose src is 'before' (default: only this checkout)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--layer", default="model.layers.3.mlp.down_proj")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--machine", default=None, help="what to call the machine in the results (default: the card or 'CPU')")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "aqflow-layer-overhead"))
    parser.add_argument("--source", default=os.path.join(os.environ.get("AQFLOW_CACHE", "resources/cache"), "smollm2", "hf-float16"),
                        help="local Hugging Face folder of the model (for the model folder)")
    parser.add_argument("--model-dir", help="an existing pipeline model folder instead")
    parser.add_argument("--calibration-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--snakemake", action="store_true",
                        help="also run the block's linears as Snakemake jobs with the rule script (benchmark files)")
    parser.add_argument("--warm-workers", action="store_true",
                        help="with --snakemake: the same jobs again with execution.warm_workers on (aqflow.jobs.warm_workers)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    work = Path(args.work)
    model_dir, calibration_dir = build_inputs(args)
    trees = {"before": source_tree(args.before, work)} if args.before else {}
    trees["after"] = REPO
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for label, tree in trees.items():  # a warm-up job each: page cache, bytecode caches, Triton's kernel cache
        one_job(tree, args, model_dir, calibration_dir, work / "jobs" / f"{label}-warm-up")
    for repeat in range(args.repeats):  # interleaved, so that a slow spell of the machine hits both
        for label, tree in trees.items():
            runs[label].append(one_job(tree, args, model_dir, calibration_dir, work / "jobs" / f"{label}-{repeat}"))
    workflows = {label: snakemake_jobs(tree, args, model_dir, calibration_dir, work / "snakemake" / label)
                 for label, tree in trees.items()} if args.snakemake else {}
    if args.snakemake and args.warm_workers:  # this checkout's jobs handing their call to a warm worker
        workflows["after, warm workers"] = snakemake_jobs(REPO, args, model_dir, calibration_dir,
                                                          work / "snakemake" / "after-warm", warm=True)
    device_name = runs["after"][0]["device_name"]
    report = {
        "machine": args.machine or device_name, "device": device_name, "layer": args.layer, "repeats": args.repeats,
        "quantizer": QUICK_QUANTIZER, "before": f"git archive {args.before} src" if args.before else None,
        "model_shard_bytes": sum(path.stat().st_size for path in model_dir.glob("*.safetensors")),
        "calibration_block_bytes": sum(path.stat().st_size for path in calibration_dir.glob("*.npz")),
        "command": shlex.join(["python3", "benchmarks/layer_job_overhead.py", *shown_arguments(sys.argv[1:] if argv is None else argv)]),
        "trees": {label: summarize(tree_runs) | {"runs": tree_runs} for label, tree_runs in runs.items()},
        "snakemake": workflows,
    }
    print(table(report))
    for label, workflow in workflows.items():
        print(f"Snakemake, {label}: the {len(workflow['jobs'])} linears of block {workflow['block']}, one job at a time: "
              f"median job {workflow['wall_seconds_median']:.2f} s wall, {workflow['cpu_seconds_median']:.2f} s CPU "
              f"(its quantization {workflow['quantizer_total_seconds_median']:.2f} s); whole run {workflow['snakemake_seconds']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
