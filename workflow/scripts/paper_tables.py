from pathlib import Path

from aqflow.workflow_glue import run_stage

run_stage(snakemake, "paper-tables", settings={"domains": snakemake.params.domains},
          paths={"out_dir": Path(snakemake.output.readme).parent, "expected_cells": snakemake.input.grid,
                 "domain_distances": snakemake.input.distances})
