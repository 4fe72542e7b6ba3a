from aqflow.jobs.workflow_glue import run_stage

corpora = snakemake.input.corpora
corpora = [corpora] if isinstance(corpora, str) else list(corpora)  # one file may come as a str
run_stage(snakemake, "domain-distances", settings={"quiet": True},
          paths={"model_dir": snakemake.input.model, "calibration": snakemake.input.calibration, "corpora": corpora,
                 "output": snakemake.output[0]})
