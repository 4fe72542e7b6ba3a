from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params
paths = {"model_dir": snakemake.input.model, "calibration_dir": snakemake.input.calibration,
         "previous_layers_dir": p.previous_layers_dir, "output_dir": snakemake.output.calibration,
         "inputs_output": snakemake.output.inputs,
         # a named input of one file reads as that path, of none as an empty list (block 1: the embeddings)
         "previous_inputs": str(snakemake.input.previous_inputs) if snakemake.input.previous_inputs else None,
         "previous_block_tensors": p.previous_block_tensors or None}
run_stage(snakemake, "calibrate-block", settings=stage_settings.calibrate_block(p.settings, int(snakemake.wildcards.block)),
          paths=paths)
