# Decode speed and memory (stage speed) of the model each eval.json evaluates: a variant's PV-tuned
# checkpoint when PV-tuning is on, else its stitched one; and of the fp source model. Requested by
# `snakemake` and the report only with config `speed.enabled`; by path, always.
EVALUATED_MODEL = (
    rules.pvtune.output.model if PLAN.pv_enabled else rules.stitch.output[0]
)


rule speed:
    input:
        model=current("speed", EVALUATED_MODEL),
    output:
        variant_file("speed.json"),
    log:
        "logs/speed/{model}/{bpp}bpp/{init}/{variant}.log",
    benchmark:
        "logs/benchmarks/speed/{model}/{bpp}bpp/{init}/{variant}.tsv"
    priority: PLAN.cell_priority
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("speed")
    resources:
        **PLAN.resources("speed"),
    params:
        settings=PLAN.speed_settings(),
    script:
        "../scripts/speed.py"


rule speed_fp:
    input:
        model=current("speed_fp", model_dir),
    output:
        "results/{model}/fp/speed.json",
    log:
        "logs/speed/{model}/fp.log",
    benchmark:
        "logs/benchmarks/speed_fp/{model}.tsv"
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("speed")
    resources:
        **PLAN.resources("speed"),
    params:
        settings=PLAN.speed_settings(),
    script:
        "../scripts/speed.py"
