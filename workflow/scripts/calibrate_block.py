from aqflow.workflow_glue import run_stage

p = snakemake.params
argv = [
    "--model-dir", snakemake.input.model, "--calibration-dir", snakemake.input.calibration,
    "--block", snakemake.wildcards.block, "--previous-layers-dir", p.previous_layers_dir,
    "--output-dir", snakemake.output.calibration, "--inputs-output", snakemake.output.inputs,
    "--batch-size", str(p.batch_size), "--quiet",
]
# a named input of one file reads as that path, of none as an empty list (block 1: the embeddings)
if snakemake.input.previous_inputs:
    argv += ["--previous-inputs", str(snakemake.input.previous_inputs)]
if p.previous_block_tensors:
    argv += ["--previous-block-tensors", p.previous_block_tensors]
run_stage(snakemake, "calibrate-block", argv)
