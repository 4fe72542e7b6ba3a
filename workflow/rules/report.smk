# The report's workflow description (workflow/report/workflow.rst) sees only the config: it names the
# corpus each target model was calibrated on from this entry (a model's text world picks its corpus).
config["report_calibration_corpora"] = {
    model: PLAN.text_corpus(model, "calibration") for model in PLAN.target_models()
}


# The speed figure is an output only with speed on: a finished run without it stays current.
SPEED_FIGURE = (
    {
        "speed": report(
            "results/report/speed.png",
            caption="../report/speed.rst",
            category="Speed",
        )
    }
    if PLAN.speed_enabled
    else {}
)


rule report:
    input:
        evals=current("report", target_evals() + baseline_evals()),
        pv_logs=current("report", pv_train_logs()),
        speeds=current("report", speed_files()),
        # the checkpoint whose layer list the benchmark params below are computed from
        calibrations=current("report", target_calibrations),
    output:
        **SPEED_FIGURE,
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
        stage_times=report(
            "results/report/stage_times.csv",
            caption="../report/stage_times.rst",
            category="Summary",
        ),
    log:
        "logs/report.log",
    benchmark:
        "logs/benchmarks/report.tsv"
    conda:
        "../../envs/report.yaml"
    threads: PLAN.threads("report")
    resources:
        **PLAN.resources("report"),
    params:
        # read where present, not inputs: a missing timing (results made before benchmark files,
        # or logs cleaned) must not rerun the jobs it times
        benchmarks=job_benchmarks,
    script:
        "../scripts/report.py"
