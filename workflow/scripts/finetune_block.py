from aqflow.workflow_glue import run_stage

p = snakemake.params
argv = [
    "--model-dir", snakemake.input.model, "--calibration-dir", snakemake.input.calibration,
    "--block", snakemake.wildcards.block, "--layers-dir", p.layers_dir, "--output-dir", snakemake.output[0],
    "--epochs", str(p.epochs), "--lr", str(p.lr), "--batch-size", str(p.batch_size), "--seed", str(p.seed), "--quiet",
]
# a named input of one file reads as that path, of none as an empty list (block 0: the embeddings)
if snakemake.input.inputs:
    argv += ["--inputs", str(snakemake.input.inputs)]
run_stage(snakemake, "finetune-block", argv)
