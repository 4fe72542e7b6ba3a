from aqflow.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "fetch-data", [
    "--corpus", snakemake.wildcards.corpus, "--output", snakemake.output.corpus,
    "--calibration-fraction", str(p.calibration_fraction), "--seed", str(p.seed),
])
