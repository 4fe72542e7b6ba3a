rule evaluate_quantized:
    input:
        model=rules.stitch.output[0],
        layer_metrics=layer_metrics,
        tuned_blocks=finetuned_blocks,
        corpora=evaluation_corpora,
    output:
        variant_file(PRE_PV_EVAL),
    log:
        "logs/evaluate/{model}/{bpp}bpp/{init}/{variant}.log",
    benchmark:
        "logs/benchmarks/evaluate_quantized/{model}/{bpp}bpp/{init}/{variant}.tsv"
    priority: cell_priority
    conda:
        "../../envs/evaluate.yaml"
    container:
        CONTAINER
    threads: rule_threads("evaluate")
    resources:
        **rule_resources("evaluate"),
    params:
        evaluation=EVALUATION_SETTINGS,
        domains=lambda w: evaluation_domains(w.model),
        settings=quantizer_settings,
        calibration=calibration_settings,
        label=lambda w: f"{w.model}/{w.bpp}bpp/{w.init}/{w.variant}",
    script:
        "../scripts/evaluate.py"


rule evaluate_fp:
    input:
        model=model_dir,
        layer_metrics=[],
        tuned_blocks=[],
        corpora=evaluation_corpora,
    output:
        "results/{model}/fp/eval.json",
    log:
        "logs/evaluate/{model}/fp.log",
    benchmark:
        "logs/benchmarks/evaluate_fp/{model}.tsv"
    conda:
        "../../envs/evaluate.yaml"
    container:
        CONTAINER
    threads: rule_threads("evaluate")
    resources:
        **rule_resources("evaluate"),
    params:
        evaluation=EVALUATION_SETTINGS,
        domains=lambda w: evaluation_domains(w.model),
        settings={},
        calibration={},
        label=lambda w: f"{w.model}/fp",
    script:
        "../scripts/evaluate.py"
