"""Running stages as Snakemake jobs: the rule scripts' glue (`workflow_glue`), a stage call inside a job (`stage_jobs`), warm workers, the GPU pool."""
