import json

from aqflow.jobs import stage_settings
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
# one perplexity per evaluation domain (config.yaml `text`): its name, protocol and corpus file
corpora = snakemake.input.get("corpora", [])
corpora = [corpora] if isinstance(corpora, str) else list(corpora)  # one file may come as a str
domains = [(name, protocol, corpus) for (name, protocol), corpus in zip(p.domains, corpora)]
settings = stage_settings.evaluate(p.evaluation, p.label, upstream, p.execution, with_perplexity=bool(domains))
paths = {"model_dir": snakemake.input.model, "output": snakemake.output[0], "domain": domains or None,
         "pre_pv": snakemake.input.pre_pv if pvtune else None}
run_stage(snakemake, "evaluate", settings=settings, paths=paths)
