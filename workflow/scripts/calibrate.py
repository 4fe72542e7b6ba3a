from aqflow.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "calibrate", [
    "--model-dir", snakemake.input.model, "--corpus", snakemake.input.corpus, "--output-dir", snakemake.output[0],
    "--num-windows", str(p.num_windows), "--window-tokens", str(p.window_tokens), "--seed", str(p.seed),
    "--propagation", p.propagation, "--batch-size", str(p.batch_size), "--quiet",
    # the job's GPUs (resources.gpu): more than one shards the windows over them (same XᵀX; fp only)
    "--num-devices", str(max(1, snakemake.resources.gpu) if p.propagation == "fp" else 1),
])
