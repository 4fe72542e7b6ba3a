from aqflow.workflow_glue import run_stage, settings_argv

run_stage(snakemake, "quantize-layer", [
    "--model-dir", snakemake.input.model, "--calibration-dir", snakemake.input.calibration,
    "--layer", snakemake.wildcards.layer, "--output", snakemake.output.layer, "--metrics", snakemake.output.metrics,
    *settings_argv(snakemake.params.settings),
])
