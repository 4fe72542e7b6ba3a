from aqflow.workflow_glue import run_stage

out = snakemake.output
run_stage(snakemake, "report", [
    *snakemake.input.evals, "--csv", out.table, "--parquet", out.parquet, "--pareto", out.pareto, "--layers", out.layers,
    "--pv-curves", out.pv_curves, "--pv-logs", *snakemake.input.pv_logs,
    "--stage-times", out.stage_times, "--benchmarks", *snakemake.input.benchmarks,
])
