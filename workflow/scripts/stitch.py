from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "stitch",
          settings={"num_codebooks": p.num_codebooks, "nbits": p.nbits, "group_size": p.group_size},
          paths={"model_dir": snakemake.input.model, "layers_dir": p.layers_dirs,
                 "replace_tensors": p.replace_tensors, "output_dir": snakemake.output[0]})
