from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "finetune-block", settings=stage_settings.finetune_block(p.settings, int(snakemake.wildcards.block)),
          paths={"model_dir": snakemake.input.model, "calibration_dir": snakemake.input.calibration,
                 "layers_dir": p.layers_dir, "output_dir": snakemake.output[0],
                 # a named input of one file reads as that path, of none as an empty list (block 0: the embeddings)
                 "inputs": str(snakemake.input.inputs) if snakemake.input.inputs else None})
