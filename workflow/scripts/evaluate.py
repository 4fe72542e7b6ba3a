from aqflow.jobs.workflow_glue import run_job

run_job(snakemake, "evaluate")  # what this job hands the stage: aqflow.jobs.workflow_glue
