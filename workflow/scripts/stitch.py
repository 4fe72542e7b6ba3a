from aqflow.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "stitch", [
    "--model-dir", snakemake.input.model, "--layers-dir", *p.layers_dirs, "--output-dir", snakemake.output[0],
    "--replace-tensors", *p.replace_tensors, "--num-codebooks", str(p.num_codebooks), "--nbits", str(p.nbits), "--group-size", str(p.group_size),
])
