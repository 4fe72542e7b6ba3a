# Path helpers and input functions: everything the rules compute about paths lives here.
import hashlib
import json
import os
import re
from types import SimpleNamespace


wildcard_constraints:
    model="[^/]+",
    bpp=r"\d+",
    init="[^/]+",
    variant=r"b\d+(e\d+)?",
    layer="[^/]+",
    corpus="[^/]+",
    block=r"\d+",


CALIBRATION = config["calibration"]
CALIBRATION_ID = (
    f"{CALIBRATION['corpus']}-n{CALIBRATION['num_windows']}-t{CALIBRATION['window_tokens']}"
    f"-s{CALIBRATION.get('seed', 0)}-{CALIBRATION.get('propagation', 'fp')}"
)
EVAL_CORPORA = {"wikitext2": "wikitext2-standin", "c4": "c4-standin"}
SEQUENTIAL = CALIBRATION.get("propagation", "fp") == "sequential"
BLOCK_FINETUNE = dict(CALIBRATION.get("block_finetune") or {})
FINETUNE = bool(BLOCK_FINETUNE.pop("enabled", False))
if FINETUNE and not SEQUENTIAL:
    raise ValueError(
        "calibration.block_finetune.enabled needs calibration.propagation: sequential "
        "(in fp mode every block is calibrated from the full-precision model)"
    )
# the image every rule runs in with `--sdm apptainer` (built from docker/Dockerfile)
CONTAINER = config["container"]


def canonical(mapping):
    """A settings dict with sorted keys: Snakemake compares params as written, so the same settings
    in another key order would otherwise look changed and rerun jobs."""
    return {key: mapping[key] for key in sorted(mapping)}


CALIBRATION_SETTINGS = canonical(
    {
        key: canonical(value) if isinstance(value, dict) else value
        for key, value in CALIBRATION.items()
    }
)
EVALUATION_SETTINGS = canonical(config["evaluation"])
PVTUNE = config.get("pvtune", {"enabled": False})
PV_ENABLED = PVTUNE["enabled"]
# every PV-tuning setting but the switch and the corpus (an input); keys left out of the config
# take the stage's defaults (the paper's settings)
PVTUNE_SETTINGS = canonical(
    {
        key: value
        for key, value in PVTUNE.items()
        if key not in ("enabled", "corpus", "save_state_every")
    }
)
# With PV-tuning on, eval.json is the PV-tuned model's evaluation (with the pre-PV one embedded)
# and the stitched model's own evaluation is written beside it.
PRE_PV_EVAL = "eval_pre_pv.json" if PV_ENABLED else "eval.json"


INITS = ("greedy", "oaem")


def check_wildcards(wildcards):
    """Refuse an impossible target while the DAG is built (`snakemake -n` included), naming the
    wildcard and its allowed values, instead of failing in a job hours later."""
    given = dict(wildcards.items())
    allowed = {  # wildcard -> (where its values come from, the values)
        "model": ("config models", sorted(config["models"])),
        "bpp": ("config bitrates", sorted(str(key) for key in config["bitrates"])),
        "init": ("the known inits", list(INITS)),
    }
    for name, (where, values) in allowed.items():
        if name in given and str(given[name]) not in values:
            raise ValueError(
                f"wildcard {name}={given[name]!r} is not one of {where}: allowed {values}"
            )
    if "variant" in given:
        beam, _, epochs = given["variant"][1:].partition("e")
        if int(beam) < 1 or (epochs and int(epochs) < 1):
            raise ValueError(
                f"wildcard variant={given['variant']!r}: beam and epochs must be >= 1 "
                "(b<beam> or b<beam>e<epochs>, e.g. b8 or b8e20)"
            )
    return wildcards


def model_dir(wildcards):
    check_wildcards(wildcards)
    return f"resources/models/{wildcards.model}"


def corpus_path(name):
    return f"resources/data/{name}.parquet"


def calibration_dir(wildcards):
    return f"results/{wildcards.model}/calib/{CALIBRATION_ID}"


def block_of(layer):
    """`model.layers.3.mlp.down_proj` -> 3 (the first dotted integer, as quantize-layer reads it)."""
    match = re.match(r"^(?:.*?\.)?(\d+)\.(.+)$", layer)
    if match is None:
        raise ValueError(f"layer {layer!r} has no block index")
    return int(match.group(1))


def layer_calibration_dir(wildcards):
    """The XᵀX of a layer's block: shared (fp mode, and block 0 in sequential mode) or, for a block
    after the first in sequential mode, the variant's own (it depends on its quantized blocks).
    """
    block = block_of(wildcards.layer)
    if SEQUENTIAL and block > 0:
        return f"{variant_dir(wildcards)}/calib/block{block}"
    return calibration_dir(wildcards)


def num_blocks(wildcards):
    folder = checkpoints.calibrate.get(
        model=wildcards.model, calib=CALIBRATION_ID
    ).output[0]
    with open(f"{folder}/calibration.json") as handle:
        return json.load(handle)["blocks"]


def block_layer_artifacts(wildcards, block):
    base = variant_dir(wildcards)
    return [
        f"{base}/layers/{layer}.safetensors"
        for layer in quantized_layers(wildcards)
        if block_of(layer) == block
    ]


def tuned_block_dir(wildcards, block):
    return f"{variant_dir(wildcards)}/tuned/block{block}"


def block_inputs_path(wildcards, block):
    """Inputs of `block` in the quantized model (a temporary artifact of its calibrate_block job)."""
    return f"{variant_dir(wildcards)}/calib/block{block}.inputs.safetensors"


def block_inputs_output(path):
    """Block inputs are removed once used (temp), unless calibration.keep_block_inputs: kept, a
    later rerun of block i starts from block i-1's stored inputs instead of recomputing from block 1.
    """
    return path if CALIBRATION.get("keep_block_inputs", False) else temp(path)


def previous_block_layers(wildcards):
    """What calibrate_block of block i runs: block i-1 as quantized (and tuned, if enabled)."""
    previous = int(wildcards.block) - 1
    if FINETUNE:
        return [tuned_block_dir(wildcards, previous)]
    return block_layer_artifacts(wildcards, previous)


def previous_block_inputs(wildcards):
    previous = int(wildcards.block) - 1
    return [block_inputs_path(wildcards, previous)] if previous >= 1 else []


def finetune_inputs(wildcards):
    """The inputs of the block being tuned; block 0's are the embeddings, recomputed."""
    block = int(wildcards.block)
    return [block_inputs_path(wildcards, block)] if block >= 1 else []


def finetuned_blocks(wildcards):
    """Every tuned block folder of a variant (none unless block fine-tuning is enabled)."""
    if not FINETUNE:
        return []
    return [tuned_block_dir(wildcards, block) for block in range(num_blocks(wildcards))]


def stitch_layers_dirs(wildcards):
    """Where stitch finds the layers: the tuned block folders, or the variant's layers folder."""
    return finetuned_blocks(wildcards) or [f"{variant_dir(wildcards)}/layers"]


def variant_dir(wildcards):
    check_wildcards(wildcards)
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


def unchanged_since_written(path):
    """Refuse, while the DAG is built, a finished file whose bytes no longer match the sha256
    recorded beside it (`<file>.sha256`, written by aqflow): caught here, before Snakemake
    deletes the outputs of the job it would rerun (stitch's model/). Missing files pass.
    """
    record = f"{path}.sha256"
    if not (os.path.isfile(path) and os.path.isfile(record)):
        return path
    with open(record) as handle:
        expected = handle.read().split(" ")[0]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"{path}: corrupt: its sha256 is not the one recorded in {record} when it was "
            f"written; delete {path} (and {record}) and rerun to redo it"
        )
    return path


def checked_layer_artifacts(wildcards):
    """The layers stitch reads, each checked against its recorded checksum (see above)."""
    return [unchanged_since_written(path) for path in layer_artifacts(wildcards)]


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
