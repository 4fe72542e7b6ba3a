import json

from aqflow.jobs.workflow_glue import block_finetune_summaries, layer_summaries, run_stage

p = snakemake.params
wildcards = dict(snakemake.wildcards)
layers = layer_summaries(snakemake.input.layer_metrics)
upstream = {
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
        upstream["pvtune"] = json.load(handle)
ev = p.evaluation
# progress bars (perplexity batches, zero-shot requests) go to the job's log
settings = {"label": p.label, "upstream": upstream,
            "context": ev["context"], "c4_windows": ev["c4_windows"], "batch_size": ev["batch_size"],
            "tasks": ev["tasks"], "cpu_kernel": ev["cpu_kernel"], "gpu_kernel": ev["gpu_kernel"],
            "task_batch_size": ev.get("task_batch_size"),
            "max_windows": ev.get("max_windows"), "task_limit": ev.get("task_limit"),
            # how the job runs, not what it measures: read from the config, not a rule param, so
            # changing it reruns no evaluation
            "logits_budget_gib": snakemake.config["execution"]["logits_budget_gib"]}
# one perplexity per evaluation domain (config.yaml `text`): its name, protocol and corpus file
corpora = snakemake.input.get("corpora", [])
corpora = [corpora] if isinstance(corpora, str) else list(corpora)  # one file may come as a str
domains = [(name, protocol, corpus) for (name, protocol), corpus in zip(p.domains, corpora)]
if not domains:
    settings["perplexity"] = []  # no domain: no perplexity
paths = {"model_dir": snakemake.input.model, "output": snakemake.output[0], "domain": domains or None,
         "pre_pv": snakemake.input.pre_pv if pvtune else None}
run_stage(snakemake, "evaluate", settings=settings, paths=paths)
