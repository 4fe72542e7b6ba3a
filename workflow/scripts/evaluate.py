import json
import tempfile

from aqflow.workflow_glue import block_finetune_summaries, layer_summaries, run_stage

p = snakemake.params
wildcards = dict(snakemake.wildcards)
layers = layer_summaries(snakemake.input.layer_metrics)
settings = {
    "model": wildcards["model"],
    "bpp": int(wildcards["bpp"]) if "bpp" in wildcards else None,
    "quantizer": dict(p.settings),
    "calibration": dict(p.calibration),
    "evaluation": dict(p.evaluation),
    "layers": layers,
    "block_finetune": block_finetune_summaries(snakemake.input.tuned_blocks),
    "quantization_seconds": sum(layer["total_seconds"] for layer in layers) if layers else None,
}
pvtune = snakemake.input.get("pvtune")
if pvtune:  # the PV-tuned model: its training record, and the pre-PV evaluation embedded whole
    with open(pvtune) as handle:
        settings["pvtune"] = json.load(handle)
ev = p.evaluation
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
    json.dump(settings, handle)
argv = [
    "--model-dir", snakemake.input.model, "--output", snakemake.output[0], "--label", p.label,
    "--settings", handle.name,
    "--context", str(ev["context"]), "--c4-windows", str(ev["c4_windows"]), "--batch-size", str(ev["batch_size"]),
    "--tasks", *ev["tasks"], "--cpu-kernel", ev["cpu_kernel"],
    "--gpu-kernel", ev["gpu_kernel"], "--quiet",
]
# one perplexity per evaluation domain (config.yaml `text`): its name, protocol and corpus file
corpora = snakemake.input.get("corpora", [])
corpora = [corpora] if isinstance(corpora, str) else list(corpora)  # one file may come as a str
for (name, protocol), corpus in zip(p.domains, corpora):
    argv += ["--domain", name, protocol, corpus]
if not p.domains:
    argv += ["--perplexity"]  # no domain: no perplexity
if pvtune:
    argv += ["--pre-pv", snakemake.input.pre_pv]
if ev.get("max_windows"):
    argv += ["--max-windows", str(ev["max_windows"])]
if ev.get("task_batch_size"):
    argv += ["--task-batch-size", str(ev["task_batch_size"])]
if ev.get("task_limit"):
    argv += ["--task-limit", str(ev["task_limit"])]
run_stage(snakemake, "evaluate", argv)
