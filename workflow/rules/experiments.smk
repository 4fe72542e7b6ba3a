# How far each evaluation domain of a model is from its calibration text (Jensen-Shannon divergence
# of token unigrams under the model's tokenizer): the paper tables order their domains by it and
# measure the domain-distance claim against it. A CPU job of seconds.
rule domain_distances:
    input:
        model=current("domain_distances", model_dir),
        calibration=current("domain_distances", calibration_corpus),
        corpora=current("domain_distances", evaluation_corpora),
    output:
        "results/{model}/domains.json",
    log:
        "logs/domain_distances/{model}.log",
    benchmark:
        "logs/benchmarks/domain_distances/{model}.tsv"
    conda:
        "../../envs/evaluate.yaml"
    threads: PLAN.threads("domain_distances")
    resources:
        **PLAN.resources("domain_distances"),
    script:
        "../scripts/domain_distances.py"


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
        params:
            cells=PLAN.experiment_cells("paper"),
        script:
            "../scripts/paper_grid.py"

    rule paper:
        input:
            evals=current("paper", PLAN.experiment_evals("paper")),
            grid=current("paper", rules.paper_grid.output[0]),
            # one per model, under its own tokenizer: each model's domain table, plot and claim
            distances=current(
                "paper",
                [
                    PLAN.experiment_file(
                        "paper",
                        output_path(rules.domain_distances.output[0], model=model),
                    )
                    for model in PLAN.experiment_models("paper")
                ],
            ),
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
        threads: PLAN.threads("report")
        resources:
            **PLAN.resources("report"),
        params:
            domains=PLAN.experiment_domains("paper"),
            models=PLAN.experiment_models("paper"),
        script:
            "../scripts/paper_tables.py"
