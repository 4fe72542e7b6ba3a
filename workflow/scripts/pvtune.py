from pathlib import Path

from aqflow.jobs.workflow_glue import run_stage_on_gpus

out = snakemake.output
# the PV-tuning settings of config.yaml, flat (the loop's and the data's; a key left out takes the
# stage's default); how often the state is saved is no param (it changes no result)
# (its progress bar, steps done and left with an estimate, goes to the job's log)
settings = {**snakemake.params.settings, "save_state_every": snakemake.config["pvtune"]["save_state_every"]}
paths = {
    "model_dir": snakemake.input.model, "checkpoint_dir": snakemake.input.checkpoint, "corpus": snakemake.input.corpus,
    "output_dir": out.model, "train_log": out.train_log, "metrics": out.metrics,
    # beside the outputs, not among them: Snakemake deletes a failed job's outputs, not this, so a
    # rerun resumes
    "state_dir": str(Path(out.metrics).parent / "state"),
}
# the job's GPUs (resources.gpu): more than one runs data-parallel under torchrun
run_stage_on_gpus(snakemake, "pvtune", settings, paths, snakemake.resources.gpu)
