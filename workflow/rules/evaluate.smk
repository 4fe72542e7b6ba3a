rule evaluate_quantized:
    input:
        model=current("evaluate_quantized", rules.stitch.output[0]),
        layer_metrics=current("evaluate_quantized", layer_metrics),
        tuned_blocks=current("evaluate_quantized", finetuned_blocks),
        corpora=current("evaluate_quantized", evaluation_corpora),
    output:
        variant_file(PRE_PV_EVAL),
    log:
        "logs/evaluate/{model}/{bpp}bpp/{init}/{variant}.log",
    benchmark:
        "logs/benchmarks/evaluate_quantized/{model}/{bpp}bpp/{init}/{variant}.tsv"
    priority: PLAN.cell_priority
    conda:
        "../../envs/evaluate.yaml"
    threads: PLAN.threads("evaluate")
    resources:
        **PLAN.resources("evaluate"),
    params:
        evaluation=PLAN.evaluation_settings(),
        domains=PLAN.domains,
        settings=PLAN.quantizer_settings,
        calibration=PLAN.calibration_record,
        label=PLAN.variant_label,
        execution=PLAN.execution,
    script:
        "../scripts/evaluate.py"


rule evaluate_fp:
    input:
        model=current("evaluate_fp", model_dir),
        layer_metrics=[],
        tuned_blocks=[],
        corpora=current("evaluate_fp", evaluation_corpora),
    output:
        "results/{model}/fp/eval.json",
    log:
        "logs/evaluate/{model}/fp.log",
    benchmark:
        "logs/benchmarks/evaluate_fp/{model}.tsv"
    conda:
        "../../envs/evaluate.yaml"
    threads: PLAN.threads("evaluate")
    resources:
        **PLAN.resources("evaluate"),
    params:
        evaluation=PLAN.evaluation_settings(),
        domains=PLAN.domains,
        settings={},
        calibration={},
        label=PLAN.fp_label,
        execution=PLAN.execution,
    script:
        "../scripts/evaluate.py"
