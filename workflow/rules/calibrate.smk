checkpoint calibrate:
    input:
        model=model_dir,
        corpus=lambda w: corpus_path(text_corpus(w.model, "calibration")),
    output:
        directory("results/{model}/calib/{calib}"),
    log:
        "logs/calibrate/{model}/{calib}.log",
    benchmark:
        "logs/benchmarks/calibrate/{model}/{calib}.tsv"
    priority: model_priority
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("calibrate")
    resources:
        **rule_resources("calibrate"),
    params:
        settings=CALIBRATE_SETTINGS,
    script:
        "../scripts/calibrate.py"


# Sequential propagation: block i >= 1 of a variant is calibrated on the outputs of its quantized
# (and, if enabled, tuned) block i-1; the job stores block i's inputs for block i+1 (num_windows x
# window_tokens x hidden values: temporary unless calibration.keep_block_inputs).
rule calibrate_block:
    input:
        model=model_dir,
        calibration=calibration_dir,
        previous_layers=previous_block_layers,
        previous_inputs=previous_block_inputs,
    output:
        calibration=directory(
            "results/{model}/{bpp}bpp/{init}/{variant}/calib/block{block}"
        ),
        inputs=block_inputs_output(
            "results/{model}/{bpp}bpp/{init}/{variant}/calib/block{block}.inputs.safetensors"
        ),
    log:
        "logs/calibrate_block/{model}/{bpp}bpp/{init}/{variant}/block{block}.log",
    benchmark:
        "logs/benchmarks/calibrate_block/{model}/{bpp}bpp/{init}/{variant}/block{block}.tsv"
    priority: cell_priority
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("calibrate_block")
    resources:
        **rule_resources("calibrate_block"),
    params:
        previous_layers_dir=lambda w: (
            tuned_block_dir(w, int(w.block) - 1)
            if FINETUNE
            else f"{variant_dir(w)}/layers"
        ),
        previous_block_tensors=lambda w: (
            f"{tuned_block_dir(w, int(w.block) - 1)}/block.safetensors"
            if FINETUNE
            else ""
        ),
        settings=CALIBRATE_BLOCK_SETTINGS,
    script:
        "../scripts/calibrate_block.py"


rule finetune_block:
    input:
        model=model_dir,
        calibration=calibration_dir,
        layers=lambda w: block_layer_artifacts(w, int(w.block)),
        inputs=finetune_inputs,
    output:
        directory("results/{model}/{bpp}bpp/{init}/{variant}/tuned/block{block}"),
    log:
        "logs/finetune_block/{model}/{bpp}bpp/{init}/{variant}/block{block}.log",
    benchmark:
        "logs/benchmarks/finetune_block/{model}/{bpp}bpp/{init}/{variant}/block{block}.tsv"
    priority: cell_priority
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("finetune_block")
    resources:
        **rule_resources("finetune_block"),
    params:
        layers_dir=lambda w: f"{variant_dir(w)}/layers",
        settings=BLOCK_FINETUNE,
    script:
        "../scripts/finetune_block.py"
