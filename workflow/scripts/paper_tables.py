from pathlib import Path

from aqflow import artifacts
from aqflow.workflow_glue import run_stage

# the grid, kept beside the tables: `python -m aqflow paper-tables --expected-cells
# results/paper/grid.json --out-dir results/paper` redraws them from whatever cells exist
artifacts.write_json(snakemake.output.grid, snakemake.params.cells)
run_stage(snakemake, "paper-tables", settings={"domains": snakemake.params.domains},
          paths={"out_dir": Path(snakemake.output.readme).parent, "expected_cells": snakemake.output.grid})
