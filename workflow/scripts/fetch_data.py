from aqflow.jobs import stage_settings
from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params  # p.user: a user corpus's config entry (its file, how to read it); {} for built-ins
run_stage(snakemake, "fetch-data",
          settings=stage_settings.fetch_data(snakemake.wildcards.corpus, p.user, p.calibration_fraction, p.seed),
          paths={"output": snakemake.output.corpus, "file": p.user.get("path")})
