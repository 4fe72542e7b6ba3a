from aqflow.jobs.workflow_glue import run_job

run_job(snakemake, "fetch-model")  # what this job hands the stage: aqflow.jobs.workflow_glue
