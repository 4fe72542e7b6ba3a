from aqflow.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "fetch-model", [
    "--preset", p.preset, "--output-dir", snakemake.output[0], "--dtype", p.dtype,
    "--tiny-layers", str(p.tiny_layers), "--tiny-hidden", str(p.tiny_hidden),
])
