# PV-tuning of a stitched checkpoint, and the evaluation of its result (only when enabled).
if PV_ENABLED:

    rule pvtune:
        input:
            model=model_dir,
            checkpoint=rules.stitch.output[0],
            corpus=lambda w: corpus_path(text_corpus(w.model, "pvtune")),
        output:
            model=directory("results/{model}/{bpp}bpp/{init}/{variant}/pv/model"),
            train_log="results/{model}/{bpp}bpp/{init}/{variant}/pv/train_log.parquet",
            metrics="results/{model}/{bpp}bpp/{init}/{variant}/pv/pvtune.json",
        log:
            "logs/pvtune/{model}/{bpp}bpp/{init}/{variant}.log",
        benchmark:
            "logs/benchmarks/pvtune/{model}/{bpp}bpp/{init}/{variant}.tsv"
        priority: cell_priority
        conda:
            "../../envs/quantize.yaml"
        container:
            CONTAINER
        threads: rule_threads("pvtune")
        resources:
            **rule_resources("pvtune"),
        params:
            settings=PVTUNE_SETTINGS,
        script:
            "../scripts/pvtune.py"

    rule evaluate_pvtuned:
        input:
            model=rules.pvtune.output.model,
            pvtune=rules.pvtune.output.metrics,
            pre_pv=rules.evaluate_quantized.output[0],
            layer_metrics=layer_metrics,
            tuned_blocks=finetuned_blocks,
            corpora=evaluation_corpora,
        output:
            "results/{model}/{bpp}bpp/{init}/{variant}/eval.json",
        log:
            "logs/evaluate/{model}/{bpp}bpp/{init}/{variant}-pv.log",
        benchmark:
            "logs/benchmarks/evaluate_pvtuned/{model}/{bpp}bpp/{init}/{variant}.tsv"
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
            label=lambda w: f"{w.model}/{w.bpp}bpp/{w.init}/{w.variant}+pv",
        script:
            "../scripts/evaluate.py"
