checkpoint calibrate:
    input:
        model=current("calibrate", model_dir),
        corpus=current("calibrate", calibration_corpus),
    output:
        directory("results/{model}/calib/{calib}"),
    log:
        "logs/calibrate/{model}/{calib}.log",
    benchmark:
        "logs/benchmarks/calibrate/{model}/{calib}.tsv"
    priority: PLAN.model_priority
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("calibrate")
    resources:
        **PLAN.resources("calibrate"),
    params:
        settings=PLAN.calibrate_settings(),
    script:
        "../scripts/calibrate.py"


# Sequential propagation: block i >= 1 of a variant is calibrated on the outputs of its quantized
# (and, if enabled, tuned) block i-1; the job stores block i's inputs for block i+1 (num_windows x
# window_tokens x hidden values: temporary unless calibration.keep_block_inputs).
rule calibrate_block:
    input:
        model=current("calibrate_block", model_dir),
        calibration=current("calibrate_block", calibration_dir),
        previous_layers=current("calibrate_block", previous_block_layers),
        previous_inputs=current(
            "calibrate_block", previous_block_inputs, BLOCK_INPUTS_TEMPORARY
        ),
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
    priority: PLAN.cell_priority
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("calibrate_block")
    resources:
        **PLAN.resources("calibrate_block"),
    params:
        previous_layers_dir=previous_layers_dir,
        previous_block_tensors=previous_block_tensors,
        settings=PLAN.calibrate_block_settings(),
    script:
        "../scripts/calibrate_block.py"


rule finetune_block:
    input:
        model=current("finetune_block", model_dir),
        calibration=current("finetune_block", calibration_dir),
        layers=current("finetune_block", block_layers),
        inputs=current("finetune_block", finetune_inputs, BLOCK_INPUTS_TEMPORARY),
    output:
        directory("results/{model}/{bpp}bpp/{init}/{variant}/tuned/block{block}"),
    log:
        "logs/finetune_block/{model}/{bpp}bpp/{init}/{variant}/block{block}.log",
    benchmark:
        "logs/benchmarks/finetune_block/{model}/{bpp}bpp/{init}/{variant}/block{block}.tsv"
    priority: PLAN.cell_priority
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("finetune_block")
    resources:
        **PLAN.resources("finetune_block"),
    params:
        layers_dir=layers_dir,
        settings=PLAN.block_finetune,
    script:
        "../scripts/finetune_block.py"
