# Experiment grids of config.yaml `experiments`: `snakemake paper` builds every cell of the `paper`
# grid (each an ordinary variant path, so only what is missing runs) and regenerates the paper's
# tables, claims and plots from them in results/paper/.
if "paper" in config.get("experiments", {}):

    # the grid's cells alone, in seconds and before any of them runs (`snakemake
    # results/paper/grid.json`): what `python -m aqflow paper-tables --expected-cells` lists as missing
    rule paper_grid:
        output:
            "results/paper/grid.json",
        log:
            "logs/paper_grid.log",
        benchmark:
            "logs/benchmarks/paper_grid.tsv"
        conda:
            "../../envs/report.yaml"
        container:
            CONTAINER
        params:
            cells=lambda w: experiment_cells("paper"),
        script:
            "../scripts/paper_grid.py"

    rule paper:
        input:
            evals=experiment_evals("paper"),
            grid=rules.paper_grid.output[0],
        output:
            readme="results/paper/README.md",
            runs="results/paper/runs.csv",
            cells=report(
                "results/paper/cells.csv",
                caption="../report/paper_cells.rst",
                category="Paper",
            ),
            domains=report(
                "results/paper/domains.csv",
                caption="../report/paper_domains.rst",
                category="Paper",
            ),
            claims=report(
                "results/paper/claims.csv",
                caption="../report/paper_claims.rst",
                category="Paper",
            ),
            tables=multiext("results/paper/", "cells.md", "domains.md", "claims.md"),
            beam_plot=report(
                "results/paper/beam.png",
                caption="../report/paper_plots.rst",
                category="Paper",
            ),
            rho_plot=report(
                "results/paper/rho.png",
                caption="../report/paper_plots.rst",
                category="Paper",
            ),
            domains_plot=report(
                "results/paper/domains.png",
                caption="../report/paper_plots.rst",
                category="Paper",
            ),
            pv_plot=report(
                "results/paper/pv.png",
                caption="../report/paper_plots.rst",
                category="Paper",
            ),
        log:
            "logs/paper.log",
        benchmark:
            "logs/benchmarks/paper.tsv"
        conda:
            "../../envs/report.yaml"
        container:
            CONTAINER
        threads: rule_threads("report")
        resources:
            **rule_resources("report"),
        params:
            domains=experiment_domains("paper"),
        script:
            "../scripts/paper_tables.py"
