from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params
run_stage(snakemake, "finetune-block",
          # config.yaml `calibration.block_finetune` (flat: the tuning's fields; keys left out: its defaults)
          settings={**p.settings, "block": int(snakemake.wildcards.block), "quiet": True},
          paths={"model_dir": snakemake.input.model, "calibration_dir": snakemake.input.calibration,
                 "layers_dir": p.layers_dir, "output_dir": snakemake.output[0],
                 # a named input of one file reads as that path, of none as an empty list (block 0: the embeddings)
                 "inputs": str(snakemake.input.inputs) if snakemake.input.inputs else None})
