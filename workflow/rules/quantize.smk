rule quantize_layer:
    input:
        model=model_dir,
        calibration=layer_calibration_dir,
    output:
        layer="results/{model}/{bpp}bpp/{init}/{variant}/layers/{layer}.safetensors",
        metrics="results/{model}/{bpp}bpp/{init}/{variant}/layers/{layer}.json",
    log:
        "logs/quantize_layer/{model}/{bpp}bpp/{init}/{variant}/{layer}.log",
    benchmark:
        "logs/benchmarks/quantize_layer/{model}/{bpp}bpp/{init}/{variant}/{layer}.tsv"
    priority: cell_priority
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("quantize_layer")
    resources:
        **rule_resources("quantize_layer"),
    params:
        settings=quantizer_settings,
    script:
        "../scripts/quantize_layer.py"


rule stitch:
    input:
        model=model_dir,
        layers=checked_layer_artifacts,
        tuned=finetuned_blocks,
    output:
        directory("results/{model}/{bpp}bpp/{init}/{variant}/model"),
    log:
        "logs/stitch/{model}/{bpp}bpp/{init}/{variant}.log",
    benchmark:
        "logs/benchmarks/stitch/{model}/{bpp}bpp/{init}/{variant}.tsv"
    priority: cell_priority
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("stitch")
    resources:
        **rule_resources("stitch"),
    params:
        layers_dirs=stitch_layers_dirs,
        replace_tensors=lambda w: [
            f"{folder}/block.safetensors" for folder in finetuned_blocks(w)
        ],
        num_codebooks=lambda w: quantizer_settings(w)["num_codebooks"],
        nbits=lambda w: quantizer_settings(w)["nbits"],
        group_size=lambda w: quantizer_settings(w)["group_size"],
    script:
        "../scripts/stitch.py"
