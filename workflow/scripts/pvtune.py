from aqflow.workflow_glue import flags_argv, run_stage

out = snakemake.output
run_stage(snakemake, "pvtune", [
    "--model-dir", snakemake.input.model, "--checkpoint-dir", snakemake.input.checkpoint, "--corpus", snakemake.input.corpus,
    "--output-dir", out.model, "--train-log", out.train_log, "--metrics", out.metrics,
    *flags_argv(snakemake.params.settings), "--quiet",
])
