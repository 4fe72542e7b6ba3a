from aqflow.jobs.workflow_glue import run_stage

out = snakemake.output
run_stage(snakemake, "report", settings={},
          paths={"evals": snakemake.input.evals, "csv": out.table, "parquet": out.parquet, "pareto": out.pareto,
                 "layers": out.layers, "pv_curves": out.pv_curves, "pv_logs": snakemake.input.pv_logs,
                 "speeds": snakemake.input.speeds, "speed_plot": out.get("speed"),
                 "stage_times": out.stage_times, "benchmarks": snakemake.params.benchmarks})
