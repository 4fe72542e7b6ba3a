from aqflow.jobs.workflow_glue import run_job

if __name__ == "__main__":  # not in a process a stage spawns, which imports this file again
    run_job(snakemake, "speed")
