from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

# The stage measures each path in a spawned child process, which imports this script's file as its
# main module: the guard keeps the child from running the job again.
if __name__ == "__main__":
    settings = stage_settings.speed(snakemake.params.settings, snakemake.threads)
    run_stage(snakemake, "speed", settings=settings,
              paths={"model_dir": snakemake.input.model, "output": snakemake.output[0]})
