from aqflow.jobs.workflow_glue import run_stage

p = snakemake.params
user = dict(p.user)  # a user corpus: its file and how to read it (config.yaml `corpora`); {} for built-ins
settings = {"corpus": snakemake.wildcards.corpus, "calibration_fraction": p.calibration_fraction, "seed": p.seed}
settings.update({key: user[key] for key in ("text_column", "id_column", "separator") if user.get(key) is not None})
if user.get("format") is not None:
    settings["file_format"] = user["format"]
run_stage(snakemake, "fetch-data", settings=settings, paths={"output": snakemake.output.corpus, "file": user.get("path")})
