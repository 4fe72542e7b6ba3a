from aqflow import artifacts
from aqflow.workflow_glue import run_stage

# the grid, kept beside the tables: `python -m aqflow paper-tables --expected-cells
# results/paper/grid.json --out-dir results/paper` redraws them from whatever cells exist
artifacts.write_json(snakemake.output.grid, snakemake.params.cells)
run_stage(snakemake, "paper-tables", [
    "--out-dir", str(snakemake.output.readme).rsplit("/", 1)[0], "--expected-cells", snakemake.output.grid,
    "--domains", *snakemake.params.domains,
])
