from aqflow.workflow_glue import run_stage

run_stage(snakemake, "fetch-model", [*snakemake.params.flags, "--output-dir", snakemake.output[0]])
