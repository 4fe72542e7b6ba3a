rule quantize_layer:
    input:
        model=current("quantize_layer", model_dir),
        calibration=current("quantize_layer", layer_calibration_dir),
    output:
        layer="results/{model}/{bpp}bpp/{init}/{variant}/layers/{layer}.safetensors",
        metrics="results/{model}/{bpp}bpp/{init}/{variant}/layers/{layer}.json",
    log:
        "logs/quantize_layer/{model}/{bpp}bpp/{init}/{variant}/{layer}.log",
    benchmark:
        "logs/benchmarks/quantize_layer/{model}/{bpp}bpp/{init}/{variant}/{layer}.tsv"
    priority: PLAN.cell_priority
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("quantize_layer")
    resources:
        **PLAN.resources("quantize_layer"),
    params:
        settings=PLAN.quantizer_settings,
        execution=PLAN.execution,
    script:
        "../scripts/quantize_layer.py"


rule stitch:
    input:
        model=current("stitch", model_dir),
        layers=current("stitch", layer_artifacts),
        tuned=current("stitch", finetuned_blocks),
    output:
        directory("results/{model}/{bpp}bpp/{init}/{variant}/model"),
    log:
        "logs/stitch/{model}/{bpp}bpp/{init}/{variant}.log",
    benchmark:
        "logs/benchmarks/stitch/{model}/{bpp}bpp/{init}/{variant}.tsv"
    priority: PLAN.cell_priority
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("stitch")
    resources:
        **PLAN.resources("stitch"),
    params:
        layers_dirs=stitch_layers_dirs,
        replace_tensors=replaced_block_tensors,
        num_codebooks=PLAN.quantizer_setting("num_codebooks"),
        nbits=PLAN.quantizer_setting("nbits"),
        group_size=PLAN.quantizer_setting("group_size"),
    script:
        "../scripts/stitch.py"
