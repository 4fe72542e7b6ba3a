checkpoint calibrate:
    input:
        model=model_dir,
        corpus=corpus_path(CALIBRATION["corpus"]),
    output:
        directory("results/{model}/calib/{calib}"),
    log:
        "logs/calibrate/{model}/{calib}.log",
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_resources("calibrate")["cpus"]
    resources:
        mem_mb=rule_resources("calibrate")["mem_mb"],
        runtime=rule_resources("calibrate")["runtime"],
        gpu=rule_resources("calibrate")["gpu"],
    params:
        num_windows=CALIBRATION["num_windows"],
        window_tokens=CALIBRATION["window_tokens"],
        seed=CALIBRATION.get("seed", 0),
        propagation=CALIBRATION.get("propagation", "fp"),
        batch_size=CALIBRATION.get("batch_size", 4),
    script:
        "../scripts/calibrate.py"
