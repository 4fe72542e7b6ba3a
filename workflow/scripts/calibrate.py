from aqflow.jobs.workflow_glue import run_stage

settings = dict(snakemake.params.settings)  # config.yaml `calibration`: the stage's settings among it
# the job's GPUs (resources.gpu): more than one shards the windows over them (same XᵀX; fp only)
if settings["propagation"] == "fp":
    settings["num_devices"] = max(1, snakemake.resources.gpu)
# progress bars (tqdm) go to the job's log: a 3B calibration takes minutes
run_stage(snakemake, "calibrate", settings=settings,
          paths={"model_dir": snakemake.input.model, "corpus": snakemake.input.corpus, "output_dir": snakemake.output[0]})
