rule report:
    input:
        evals=target_evals() + baseline_evals(),
        pv_logs=pv_train_logs(),
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
        pv_curves=report(
            "results/report/pvtune.png",
            caption="../report/pvtune.rst",
            category="PV-tuning",
        ),
    log:
        "logs/report.log",
    conda:
        "../../envs/aqflow.yaml"
    threads: 1
    resources:
        mem_mb=rule_resources("report")["mem_mb"],
        runtime=rule_resources("report")["runtime"],
    script:
        "../scripts/report.py"
