from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

run_stage(snakemake, "quantize-layer", settings=stage_settings.quantize_layer(snakemake.params.settings),
          paths={"model_dir": snakemake.input.model, "calibration_dir": snakemake.input.calibration,
                 "layer": snakemake.wildcards.layer, "output": snakemake.output.layer,
                 "metrics": snakemake.output.metrics},
          execution=snakemake.params.execution)
