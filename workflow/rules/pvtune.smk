# PV-tuning of a stitched checkpoint, and the evaluation of its result (only when enabled).
if PLAN.pv_enabled:

    rule pvtune:
        input:
            model=current("pvtune", model_dir),
            checkpoint=current("pvtune", rules.stitch.output[0]),
            corpus=current("pvtune", pvtune_corpus),
            # none: the saved state it resumes from, checked (aqflow.jobs.currency)
            state=checked_pvtune_state,
        output:
            model=directory("results/{model}/{bpp}bpp/{init}/{variant}/pv/model"),
            train_log="results/{model}/{bpp}bpp/{init}/{variant}/pv/train_log.parquet",
            metrics="results/{model}/{bpp}bpp/{init}/{variant}/pv/pvtune.json",
        log:
            "logs/pvtune/{model}/{bpp}bpp/{init}/{variant}.log",
        benchmark:
            "logs/benchmarks/pvtune/{model}/{bpp}bpp/{init}/{variant}.tsv"
        priority: PLAN.cell_priority
        conda:
            "../../envs/quantize.yaml"
        threads: PLAN.threads("pvtune")
        resources:
            **PLAN.resources("pvtune"),
        params:
            settings=PLAN.pvtune_settings(),
            execution=PLAN.execution,
        script:
            "../scripts/pvtune.py"

    rule evaluate_pvtuned:
        input:
            model=current("evaluate_pvtuned", rules.pvtune.output.model),
            pvtune=current("evaluate_pvtuned", rules.pvtune.output.metrics),
            pre_pv=current("evaluate_pvtuned", rules.evaluate_quantized.output[0]),
            layer_metrics=current("evaluate_pvtuned", layer_metrics),
            tuned_blocks=current("evaluate_pvtuned", finetuned_blocks),
            corpora=current("evaluate_pvtuned", evaluation_corpora),
        output:
            "results/{model}/{bpp}bpp/{init}/{variant}/eval.json",
        log:
            "logs/evaluate/{model}/{bpp}bpp/{init}/{variant}-pv.log",
        benchmark:
            "logs/benchmarks/evaluate_pvtuned/{model}/{bpp}bpp/{init}/{variant}.tsv"
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
            label=PLAN.pvtuned_label,
            execution=PLAN.execution,
        script:
            "../scripts/evaluate.py"
