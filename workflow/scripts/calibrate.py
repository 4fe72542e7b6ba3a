from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import job_gpus, run_stage

# the job's GPUs (resources.gpu): more than one shards the windows over them (fp only)
run_stage(snakemake, "calibrate", settings=stage_settings.calibrate(snakemake.params.settings, job_gpus(snakemake)),
          paths={"model_dir": snakemake.input.model, "corpus": snakemake.input.corpus, "output_dir": snakemake.output[0]})
