from pathlib import Path

from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage_on_gpus

out = snakemake.output
paths = {
    "model_dir": snakemake.input.model, "checkpoint_dir": snakemake.input.checkpoint, "corpus": snakemake.input.corpus,
    "output_dir": out.model, "train_log": out.train_log, "metrics": out.metrics,
    # beside the outputs, not among them: Snakemake deletes a failed job's outputs, not this, so a
    # rerun resumes
    "state_dir": str(Path(out.metrics).parent / "state"),
}
# the job's GPUs (resources.gpu): more than one runs data-parallel under torchrun
run_stage_on_gpus(snakemake, "pvtune", stage_settings.pvtune(snakemake.params.settings, snakemake.params.execution),
                  paths, snakemake.resources.gpu)
