rule quantize_layer:
    input:
        model=model_dir,
        calibration=layer_calibration_dir,
    output:
        layer="results/{model}/{bpp}bpp/{init}/{variant}/layers/{layer}.safetensors",
        metrics="results/{model}/{bpp}bpp/{init}/{variant}/layers/{layer}.json",
    log:
        "logs/quantize_layer/{model}/{bpp}bpp/{init}/{variant}/{layer}.log",
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_resources("quantize_layer")["cpus"]
    resources:
        mem_mb=rule_resources("quantize_layer")["mem_mb"],
        runtime=rule_resources("quantize_layer")["runtime"],
        gpu=rule_resources("quantize_layer")["gpu"],
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
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_resources("stitch")["cpus"]
    resources:
        mem_mb=rule_resources("stitch")["mem_mb"],
        runtime=rule_resources("stitch")["runtime"],
        gpu=rule_resources("stitch")["gpu"],
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
