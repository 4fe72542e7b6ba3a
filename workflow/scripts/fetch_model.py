from aqflow.jobs.workflow_glue import run_stage

request = dict(snakemake.params.request)
path = request.pop("path", None)  # a local model folder is an input path; the rest are settings
run_stage(snakemake, "fetch-model", settings=request, paths={"output_dir": snakemake.output[0], "path": path})
