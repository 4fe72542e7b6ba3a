rule report:
    input:
        evals=target_evals() + baseline_evals(),
    output:
        table=report(
            "results/report/summary.csv",
            caption="../report/summary.rst",
            category="Summary",
        ),
        parquet="results/report/summary.parquet",
        pareto=report(
            "results/report/pareto.png",
            caption="../report/pareto.rst",
            category="Summary",
        ),
        layers=report(
            "results/report/layers.png",
            caption="../report/layers.rst",
            category="Layers",
        ),
    log:
        "logs/report.log",
    conda:
        "../../envs/report.yaml"
    container:
        CONTAINER
    threads: rule_resources("report")["cpus"]
    resources:
        mem_mb=rule_resources("report")["mem_mb"],
        runtime=rule_resources("report")["runtime"],
        gpu=rule_resources("report")["gpu"],
    script:
        "../scripts/report.py"
