# Path helpers and input functions: everything the rules compute about paths lives here.
import json
from types import SimpleNamespace


wildcard_constraints:
    model="[^/]+",
    bpp=r"\d+",
    init="greedy|oaem",
    variant=r"b\d+(e\d+)?",
    layer="[^/]+",
    corpus="[^/]+",


CALIBRATION = config["calibration"]
CALIBRATION_ID = (
    f"{CALIBRATION['corpus']}-n{CALIBRATION['num_windows']}-t{CALIBRATION['window_tokens']}"
    f"-s{CALIBRATION.get('seed', 0)}-{CALIBRATION.get('propagation', 'fp')}"
)
EVAL_CORPORA = {"wikitext2": "wikitext2-standin", "c4": "c4-standin"}


def canonical(mapping):
    """A settings dict with sorted keys: Snakemake compares params as written, so the same settings
    in another key order would otherwise look changed and rerun jobs."""
    return {key: mapping[key] for key in sorted(mapping)}


CALIBRATION_SETTINGS = canonical(CALIBRATION)
EVALUATION_SETTINGS = canonical(config["evaluation"])
PVTUNE = config.get("pvtune", {"enabled": False})
PV_ENABLED = PVTUNE["enabled"]
# every PV-tuning setting but the switch and the corpus (an input); keys left out of the config
# take the stage's defaults (the paper's settings)
PVTUNE_SETTINGS = canonical(
    {key: value for key, value in PVTUNE.items() if key not in ("enabled", "corpus")}
)
# With PV-tuning on, eval.json is the PV-tuned model's evaluation (with the pre-PV one embedded)
# and the stitched model's own evaluation is written beside it.
PRE_PV_EVAL = "eval_pre_pv.json" if PV_ENABLED else "eval.json"


def model_dir(wildcards):
    return f"resources/models/{wildcards.model}"


def corpus_path(name):
    return f"resources/data/{name}.parquet"


def calibration_dir(wildcards):
    return f"results/{wildcards.model}/calib/{CALIBRATION_ID}"


def variant_dir(wildcards):
    return f"results/{wildcards.model}/{wildcards.bpp}bpp/{wildcards.init}/{wildcards.variant}"


def bitrate(wildcards):
    if str(wildcards.bpp) not in {str(k) for k in config["bitrates"]}:
        raise ValueError(
            f"{wildcards.bpp} bpp is not in config bitrates ({sorted(config['bitrates'])})"
        )
    return {str(k): v for k, v in config["bitrates"].items()}[str(wildcards.bpp)]


def quantizer_settings(wildcards):
    """Every QuantizerSettings field a layer job uses: config defaults, overridden by the path."""
    beam, _, epochs = wildcards.variant[1:].partition("e")
    settings = dict(config["quantization"])
    settings.update(bitrate(wildcards))
    settings["init"] = wildcards.init
    settings["beam_size"] = int(beam)
    if epochs:
        settings["max_epochs"] = int(epochs)
    return canonical(settings)


def quantized_layers(wildcards):
    """Module names of the linears to quantize, as the calibration found them (a checkpoint)."""
    folder = checkpoints.calibrate.get(
        model=wildcards.model, calib=CALIBRATION_ID
    ).output[0]
    with open(f"{folder}/calibration.json") as handle:
        return json.load(handle)["layers"]


def layer_artifacts(wildcards):
    base = variant_dir(wildcards)
    return [
        f"{base}/layers/{layer}.safetensors" for layer in quantized_layers(wildcards)
    ]


def layer_metrics(wildcards):
    base = variant_dir(wildcards)
    return [f"{base}/layers/{layer}.json" for layer in quantized_layers(wildcards)]


def target_variant(target):
    epochs = f"e{target['epochs']}" if "epochs" in target else ""
    return f"results/{target['model']}/{target['bpp']}bpp/{target['init']}/b{target['beam']}{epochs}"


def target_evals():
    return [f"{target_variant(t)}/eval.json" for t in config["targets"]]


def variant_file(name):
    """The wildcard pattern of a file in a variant's folder."""
    return f"results/{{model}}/{{bpp}}bpp/{{init}}/{{variant}}/{name}"


def pv_train_logs():
    """The PV-tuning training logs of the target variants (none when PV-tuning is off)."""
    if not PV_ENABLED:
        return []
    return [f"{target_variant(t)}/pv/train_log.parquet" for t in config["targets"]]


def baseline_evals():
    return sorted({f"results/{t['model']}/fp/eval.json" for t in config["targets"]})


def all_targets(wildcards):
    """Every target variant's eval.json, the baselines, the report, and every layer artifact:
    Snakemake regenerates a deleted file only when it is requested, so listing the layers here
    makes a deleted layer rerun (with what follows it) on the next plain `snakemake`."""
    layers = []
    for target in config["targets"]:
        variant = target_variant(target)
        model = SimpleNamespace(model=target["model"])
        layers += [
            f"{variant}/layers/{layer}.safetensors" for layer in quantized_layers(model)
        ]
    return target_evals() + baseline_evals() + ["results/report/summary.csv"] + layers


def rule_resources(rule_name):
    """Resources of a rule: config `resources.<rule>` over `resources.default`."""
    merged = dict(config["resources"]["default"])
    merged.update(config["resources"].get(rule_name, {}))
    return merged
