from pathlib import Path

from aqflow.jobs.workflow_glue import run_stage

# input.distances is one domains.json per model, in the order of params.models
distances = [f"{model}={path}" for model, path in zip(snakemake.params.models, snakemake.input.distances, strict=True)]
run_stage(snakemake, "paper-tables", settings={"domains": snakemake.params.domains},
          paths={"out_dir": Path(snakemake.output.readme).parent, "expected_cells": snakemake.input.grid,
                 "domain_distances": distances})
