from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "stitch", settings=stage_settings.stitch(p.num_codebooks, p.nbits, p.group_size),
          paths={"model_dir": snakemake.input.model, "layers_dir": p.layers_dirs,
                 "replace_tensors": p.replace_tensors, "output_dir": snakemake.output[0]})
