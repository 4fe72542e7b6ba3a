from pathlib import Path

from aqflow.workflow_glue import flags_argv, run_stage_on_gpus

out = snakemake.output
# the job's GPUs (resources.gpu): more than one runs data-parallel under torchrun
run_stage_on_gpus(snakemake, "pvtune", [
    "--model-dir", snakemake.input.model, "--checkpoint-dir", snakemake.input.checkpoint, "--corpus", snakemake.input.corpus,
    "--output-dir", out.model, "--train-log", out.train_log, "--metrics", out.metrics,
    *flags_argv(snakemake.params.settings), "--quiet",
    # beside the outputs, not among them: Snakemake deletes a failed job's outputs, not this, so a
    # rerun resumes (not a param either: how often it is saved changes no result)
    "--state-dir", str(Path(out.metrics).parent / "state"),
    "--save-state-every", str(snakemake.config["pvtune"].get("save_state_every", 25)),
], snakemake.resources.gpu)
