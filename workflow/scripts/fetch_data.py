from aqflow.workflow_glue import run_stage

p = snakemake.params
argv = [
    "--corpus", snakemake.wildcards.corpus, "--output", snakemake.output.corpus,
    "--calibration-fraction", str(p.calibration_fraction), "--seed", str(p.seed),
]
if p.user:  # a user corpus: its file and how to read it (config.yaml `corpora`)
    argv += ["--file", p.user["path"], "--text-column", p.user.get("text_column", "text")]
    for key in ("format", "id_column", "separator"):
        if p.user.get(key) is not None:
            argv += ["--" + key.replace("_", "-"), str(p.user[key])]
run_stage(snakemake, "fetch-data", argv)
