from aqflow.io import artifacts

# the grid beside its tables: `python -m aqflow paper-tables --expected-cells results/paper/grid.json
# --out-dir results/paper` redraws them from whatever cells exist
artifacts.write_json(snakemake.output[0], snakemake.params.cells)
