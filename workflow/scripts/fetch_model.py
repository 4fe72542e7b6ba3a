from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

request = snakemake.params.request  # a local model folder's `path` is an input path; the rest are settings
run_stage(snakemake, "fetch-model", settings=stage_settings.fetch_model(request),
          paths={"output_dir": snakemake.output[0], "path": request.get("path")})
