from aqflow.jobs.workflow_glue import run_job

run_job(snakemake, "calibrate")  # what this job hands the stage: aqflow.jobs.workflow_glue
