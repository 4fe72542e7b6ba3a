# Path helpers and input functions: everything the rules compute about paths lives here.
import hashlib
import itertools
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

# the library's pure-Python helpers (no torch: model entries, module names), whether or not aqflow is installed here
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from aqflow.models.entries import entry_problems, fetch_model_request, parse_model_entry
from aqflow.models.folder import block_index
from aqflow.data.corpus_catalog import (
    BUILTIN_CORPORA,
    check_role,
    evaluation_protocol,
    model_text_world,
    text_choice,
)


wildcard_constraints:
    model="[^/]+",
    bpp=r"\d+",
    # any name: an unknown init is refused by check_wildcards, naming the known ones
    init="[^/]+",
    # [g{group}m{codebooks}k{codewords}-]b{beam}[e{max epochs}][s{seed}]: see parse_variant
    variant=r"(g\d+m\d+k\d+-)?b\d+(e\d+)?(s\d+)?",
    layer="[^/]+",
    corpus="[^/]+",
    block=r"\d+",


CALIBRATION = config["calibration"]
# Which corpus each role reads, per text world ("hub": WikiText-2/C4 from the hub; "offline": the
# registry stand-ins); a model reads its world's (`model_text`). User corpora: local files.
TEXT = text_choice(config.get("text"))
USER_CORPORA = config.get("corpora") or {}


def check_text_config():
    """Refuse, before any job runs, a corpus that does not exist or cannot serve its role."""
    clashes = sorted(set(USER_CORPORA) & set(BUILTIN_CORPORA))
    if clashes:
        raise ValueError(
            f"corpora: {clashes} are built-in corpus names; give user corpora other names"
        )
    for world, roles in TEXT.items():
        for role in ("calibration", "pvtune"):
            try:
                check_role(roles[role], role, USER_CORPORA)
            except (KeyError, ValueError) as error:
                raise ValueError(f"text.{world}.{role}: {error}") from None
        for name in roles["evaluation"]:
            try:
                check_role(name, "evaluation", USER_CORPORA)
            except (KeyError, ValueError) as error:
                raise ValueError(f"text.{world}.evaluation: {error}") from None


check_text_config()


def model_text(model):
    """ "hub" or "offline": the text world of a model of config.yaml (models.<name>.text picks it
    explicitly; otherwise hub presets and hub_id entries read hub text, the others the stand-ins).
    """
    if model not in config["models"]:
        raise ValueError(
            f"model {model!r} is not in config.yaml models ({sorted(config['models'])})"
        )
    return model_text_world(config["models"][model])


def text_corpus(model, role):
    """The corpus a model's `role` (calibration or pvtune) reads."""
    return TEXT[model_text(model)][role]


def evaluation_domains(model):
    """[[domain, protocol], ...]: the perplexity domains a model is evaluated on, each a corpus."""
    return [
        [name, evaluation_protocol(name, USER_CORPORA)]
        for name in TEXT[model_text(model)]["evaluation"]
    ]


def evaluation_corpora(wildcards):
    return [corpus_path(name) for name, _ in evaluation_domains(wildcards.model)]


def calibration_id(model):
    """The calibration's folder name: every setting that changes its XᵀX, the corpus first."""
    return (
        f"{text_corpus(model, 'calibration')}-n{CALIBRATION['num_windows']}"
        f"-t{CALIBRATION['window_tokens']}-s{CALIBRATION['seed']}"
        f"-{CALIBRATION['propagation']}"
    )


SEQUENTIAL = CALIBRATION["propagation"] == "sequential"
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


# what the calibrate and calibrate-block stages take of config.yaml `calibration` (keys left out:
# the stages' defaults)
CALIBRATE_SETTINGS = canonical(
    {
        key: CALIBRATION[key]
        for key in ("num_windows", "window_tokens", "seed", "propagation", "batch_size")
        if key in CALIBRATION
    }
)
CALIBRATE_BLOCK_SETTINGS = canonical(
    {key: CALIBRATION[key] for key in ("batch_size",) if key in CALIBRATION}
)


def calibration_settings(wildcards):
    """The calibration settings a variant's eval.json records, with the corpus the model read."""
    return canonical(
        {**CALIBRATION_SETTINGS, "corpus": text_corpus(wildcards.model, "calibration")}
    )


EVALUATION_SETTINGS = canonical(config["evaluation"])
PVTUNE = config.get("pvtune", {"enabled": False})
PV_ENABLED = PVTUNE["enabled"]
# every PV-tuning setting but the switch and the corpus (an input); keys left out of the config
# take the stage's defaults (the paper's settings)
# settings added after runs were made enter the params only where they differ from the behaviour
# those runs had, so adding them reruns nothing
PVTUNE_LATER_DEFAULTS = {"code_lr_scale": "absolute"}
PVTUNE_SETTINGS = canonical(
    {
        key: value
        for key, value in PVTUNE.items()
        if key not in ("enabled", "corpus", "save_state_every")
        and PVTUNE_LATER_DEFAULTS.get(key, object()) != value
    }
)
# With PV-tuning on, eval.json is the PV-tuned model's evaluation (with the pre-PV one embedded)
# and the stitched model's own evaluation is written beside it.
PRE_PV_EVAL = "eval_pre_pv.json" if PV_ENABLED else "eval.json"


GROUP_SIZE = config["quantization"]["group_size"]
# folders of results/ that are not models: published results (committed, written by hand only),
# the report and the experiment tables
RESERVED_RESULT_FOLDERS = ("published", "report", "paper")
if set(config["models"]) & set(RESERVED_RESULT_FOLDERS):
    raise ValueError(
        f"config.yaml models: {sorted(set(config['models']) & set(RESERVED_RESULT_FOLDERS))} are folders of "
        f"results/ ({list(RESERVED_RESULT_FOLDERS)}); give the model another name"
    )
# every `models:` entry parsed (a bad entry is an error naming it before anything runs)
MODEL_ENTRIES = {
    name: parse_model_entry(name, entry) for name, entry in config["models"].items()
}


@lru_cache(maxsize=None)
def checked_model(name):
    """The entry of model `name`, refused by name if config.json already shows the pipeline cannot
    quantize it (a local folder, or a hub model the hub cache holds): before any job runs.
    """
    if name not in MODEL_ENTRIES:
        raise ValueError(
            f"model {name!r} is not in config.yaml models ({sorted(MODEL_ENTRIES)})"
        )
    entry = MODEL_ENTRIES[name]
    problems = entry_problems(entry, GROUP_SIZE)
    if problems:
        raise ValueError(
            f"model {name!r} cannot be quantized by this pipeline: "
            + "; ".join(problems)
        )
    return entry


INITS = ("greedy", "oaem", "oaem-patient")


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
        settings = parse_variant(given["variant"])
        if settings["beam_size"] < 1 or settings.get("max_epochs", 1) < 1:
            raise ValueError(
                f"wildcard variant={given['variant']!r}: beam and epochs must be >= 1 "
                "([g<group>m<codebooks>k<codewords>-]b<beam>[e<epochs>][s<seed>], e.g. b8 or b8e20s43)"
            )
    return wildcards


def model_dir(wildcards):
    check_wildcards(wildcards)
    checked_model(wildcards.model)
    return output_path(rules.fetch_model.output[0], model=wildcards.model)


def fetch_model_settings(wildcards):
    """What fetch-model is asked for this model (its settings' values, and `path` for a folder)."""
    return fetch_model_request(checked_model(wildcards.model), GROUP_SIZE)


def corpus_path(name):
    return output_path(rules.fetch_data.output.corpus, corpus=name)


def user_corpus(name):
    """The config.yaml entry of a user corpus (an empty dict for built-in corpora)."""
    return USER_CORPORA.get(name, {})


def user_corpus_file(wildcards):
    """A user corpus's file (an input of fetch_data, so editing it refetches); none for built-ins."""
    entry = user_corpus(wildcards.corpus)
    return [entry["path"]] if entry else []


def calibration_dir(wildcards):
    return output_path(
        rules.calibrate.output[0],
        model=wildcards.model,
        calib=calibration_id(wildcards.model),
    )


def layer_calibration_dir(wildcards):
    """The XᵀX of a layer's block: shared (fp mode, and block 0 in sequential mode) or, for a block
    after the first in sequential mode, the variant's own (it depends on its quantized blocks).
    """
    block = block_index(wildcards.layer)
    if SEQUENTIAL and block > 0:
        variant_dir(wildcards)  # checks the wildcards and settings
        return output_path(
            rules.calibrate_block.output.calibration,
            **variant_wildcards(wildcards),
            block=block,
        )
    return calibration_dir(wildcards)


def num_blocks(wildcards):
    folder = checkpoints.calibrate.get(
        model=wildcards.model, calib=calibration_id(wildcards.model)
    ).output[0]
    with open(f"{folder}/calibration.json") as handle:
        return json.load(handle)["blocks"]


def block_layer_artifacts(wildcards, block):
    return [
        path
        for layer, path in zip(quantized_layers(wildcards), layer_artifacts(wildcards))
        if block_index(layer) == block
    ]


def tuned_block_dir(wildcards, block):
    variant_dir(wildcards)  # checks the wildcards and settings
    return output_path(
        rules.finetune_block.output[0], **variant_wildcards(wildcards), block=block
    )


def block_inputs_path(wildcards, block):
    """Inputs of `block` in the quantized model (a temporary artifact of its calibrate_block job)."""
    variant_dir(wildcards)  # checks the wildcards and settings
    return output_path(
        rules.calibrate_block.output.inputs, **variant_wildcards(wildcards), block=block
    )


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
    """The folder of a variant; its wildcards and settings are checked first (input functions call
    this while the DAG is built, so an impossible target, bit rate or geometry fails `snakemake -n`
    by name)."""
    check_wildcards(wildcards)
    quantizer_settings(wildcards)
    return f"results/{wildcards.model}/{wildcards.bpp}bpp/{wildcards.init}/{wildcards.variant}"


def variant_wildcards(wildcards):
    """The four wildcards that name a variant (of any job's wildcards, or a target's)."""
    return {
        name: getattr(wildcards, name) for name in ("model", "bpp", "init", "variant")
    }


def output_path(pattern, **wildcards):
    """One file of a rule's output pattern (`rules.<rule>.output.<name>`) with its wildcards filled
    in: the rule that writes a file is the one place its path is spelled."""
    return pattern.format(**wildcards)


def bitrate(wildcards):
    if str(wildcards.bpp) not in {str(k) for k in config["bitrates"]}:
        raise ValueError(
            f"{wildcards.bpp} bpp is not in config bitrates ({sorted(config['bitrates'])})"
        )
    return {str(k): v for k, v in config["bitrates"].items()}[str(wildcards.bpp)]


VARIANT_PATTERN = re.compile(r"^(?:g(\d+)m(\d+)k(\d+)-)?b(\d+)(?:e(\d+))?(?:s(\d+))?$")


def parse_variant(variant):
    """ "b8" -> {beam_size: 8}; "g6m2k64-b8e5s43" -> {group_size: 6, num_codebooks: 2, nbits: 6,
    beam_size: 8, max_epochs: 5, seed: 43}. A geometry prefix replaces the bit rate's codebook
    layout (a ρ sweep at one bit rate); a seed suffix replaces quantization.seed."""
    match = VARIANT_PATTERN.match(variant)
    if match is None:
        raise ValueError(
            f"variant {variant!r} is not [g<group>m<codebooks>k<codewords>-]b<beam>[e<epochs>][s<seed>]"
        )
    group, codebooks, codewords, beam, epochs, seed = match.groups()
    settings = {"beam_size": int(beam)}
    if group:
        codewords = int(codewords)
        if codewords < 2 or codewords & (codewords - 1):
            raise ValueError(
                f"variant {variant!r}: k{codewords} codewords must be a power of two"
            )
        settings.update(
            group_size=int(group),
            num_codebooks=int(codebooks),
            nbits=codewords.bit_length() - 1,
        )
    if epochs:
        settings["max_epochs"] = int(epochs)
    if seed:
        settings["seed"] = int(seed)
    return settings


def geometry_name(group_size, num_codebooks, nbits):
    """8, 2, 8 -> "g8m2k256" (as in variant paths)."""
    return f"g{group_size}m{num_codebooks}k{1 << nbits}"


def variant_name(bpp, beam, epochs=None, seed=None, geometry=None):
    """The inverse of parse_variant: the path segment of a variant. A seed or geometry equal to the
    configuration's default stays implicit, so that a grid reuses the default targets' runs (epochs
    are written whenever given, as targets always have been)."""
    quantization = config["quantization"]
    name = f"b{beam}"
    if epochs is not None:
        name += f"e{epochs}"
    if seed is not None and seed != quantization["seed"]:
        name += f"s{seed}"
    rate = {str(k): v for k, v in config["bitrates"].items()}.get(str(bpp), {})
    default = geometry_name(
        quantization["group_size"],
        rate.get("num_codebooks"),
        rate.get("nbits", 0),
    )
    return f"{geometry}-{name}" if geometry and geometry != default else name


def quantizer_settings(wildcards):
    """Every QuantizerSettings field a layer job uses: config defaults, overridden by the path
    (bit rate, then the variant's geometry, beam, epochs and seed)."""
    settings = dict(config["quantization"])
    settings.update(bitrate(wildcards))
    settings["init"] = wildcards.init
    from_path = parse_variant(wildcards.variant)
    settings.update(from_path)
    code_bits = settings["num_codebooks"] * settings["nbits"] / settings["group_size"]
    # a geometry must store the bit rate of its folder (the configured bit rates may round: the
    # tiny test model's "2" stores 1.5)
    if "group_size" in from_path and code_bits != float(wildcards.bpp):
        raise ValueError(
            f"variant {wildcards.variant!r} stores {code_bits:g} code bits per weight "
            f"(codebooks x log2(codewords) / group size), not the {wildcards.bpp} of its {wildcards.bpp}bpp folder"
        )
    return canonical(settings)


def quantized_layers(wildcards):
    """Module names of the linears to quantize, as the calibration found them (a checkpoint)."""
    folder = checkpoints.calibrate.get(
        model=wildcards.model, calib=calibration_id(wildcards.model)
    ).output[0]
    with open(f"{folder}/calibration.json") as handle:
        return json.load(handle)["layers"]


def layer_artifacts(wildcards):
    variant_dir(wildcards)  # checks the wildcards and settings
    return [
        output_path(
            rules.quantize_layer.output.layer,
            **variant_wildcards(wildcards),
            layer=layer,
        )
        for layer in quantized_layers(wildcards)
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
    variant_dir(wildcards)  # checks the wildcards and settings
    return [
        output_path(
            rules.quantize_layer.output.metrics,
            **variant_wildcards(wildcards),
            layer=layer,
        )
        for layer in quantized_layers(wildcards)
    ]


def target_wildcards(target):
    """A target of config.yaml (or a grid cell) -> the wildcards of its variant's jobs."""
    name = variant_name(
        target["bpp"],
        target["beam"],
        target.get("epochs"),
        target.get("seed"),
        target.get("geometry"),
    )
    return SimpleNamespace(
        model=target["model"], bpp=target["bpp"], init=target["init"], variant=name
    )


def target_eval(target):
    """A target's final eval.json (the PV-tuned model's when PV-tuning is on)."""
    final = rules.evaluate_pvtuned if PV_ENABLED else rules.evaluate_quantized
    return output_path(final.output[0], **variant_wildcards(target_wildcards(target)))


def target_evals():
    return [target_eval(t) for t in config["targets"]]


def variant_file(name):
    """The wildcard pattern of a file in a variant's folder."""
    return f"results/{{model}}/{{bpp}}bpp/{{init}}/{{variant}}/{name}"


def pv_train_logs():
    """The PV-tuning training logs of the target variants (none when PV-tuning is off)."""
    if not PV_ENABLED:
        return []
    return [
        output_path(
            rules.pvtune.output.train_log, **variant_wildcards(target_wildcards(t))
        )
        for t in config["targets"]
    ]


def baseline_evals():
    return sorted(
        {
            output_path(rules.evaluate_fp.output[0], model=t["model"])
            for t in config["targets"]
        }
    )


def all_targets(wildcards):
    """Every target variant's eval.json, the baselines, the report, and every layer artifact:
    Snakemake regenerates a deleted file only when it is requested, so listing the layers here
    makes a deleted layer rerun (with what follows it) on the next plain `snakemake`."""
    layers = []
    for target in config["targets"]:
        variant = variant_wildcards(target_wildcards(target))
        layers += [
            output_path(rules.quantize_layer.output.layer, **variant, layer=layer)
            for layer in quantized_layers(target_wildcards(target))
        ]
    return target_evals() + baseline_evals() + [rules.report.output.table] + layers


def target_calibrations(wildcards):
    """The calibration folders (checkpoint outputs) of the targets' models: the report's job list
    (`job_benchmarks`) reads which layers they found."""
    models = sorted({target["model"] for target in config["targets"]})
    return [calibration_dir(SimpleNamespace(model=model)) for model in models]


def job_benchmarks(wildcards):
    """The benchmark file of every job behind the report (each is an output of its job): the
    fetches, calibrations and fp evaluations of the targets' models, and each target variant's
    jobs (its layers, sequential blocks, stitch, PV-tuning and evaluations)."""
    models = sorted({target["model"] for target in config["targets"]})
    corpora = set()
    files = []
    for model in models:
        corpora.update([text_corpus(model, "calibration")])
        corpora.update(name for name, _ in evaluation_domains(model))
        if PV_ENABLED:
            corpora.add(text_corpus(model, "pvtune"))
        files += [
            output_path(rules.fetch_model.benchmark, model=model),
            output_path(
                rules.calibrate.benchmark, model=model, calib=calibration_id(model)
            ),
            output_path(rules.evaluate_fp.benchmark, model=model),
        ]
    files += [
        output_path(rules.fetch_data.benchmark, corpus=name) for name in sorted(corpora)
    ]
    for target in config["targets"]:
        files += variant_benchmarks(target_wildcards(target))
    return files


def variant_benchmarks(wildcards):
    """The benchmark files of the jobs that make one variant, its evaluations included."""
    variant = variant_wildcards(wildcards)
    blocks = range(num_blocks(wildcards))
    files = [
        output_path(rules.quantize_layer.benchmark, **variant, layer=layer)
        for layer in quantized_layers(wildcards)
    ]
    if SEQUENTIAL:  # block 0 reads the shared calibration
        files += [
            output_path(rules.calibrate_block.benchmark, **variant, block=block)
            for block in blocks[1:]
        ]
    if FINETUNE:
        files += [
            output_path(rules.finetune_block.benchmark, **variant, block=block)
            for block in blocks
        ]
    finals = [rules.stitch, rules.evaluate_quantized]
    if PV_ENABLED:
        finals += [rules.pvtune, rules.evaluate_pvtuned]
    return files + [output_path(rule.benchmark, **variant) for rule in finals]


def configured_resources(name):
    """config `resources.<name>` over `resources.default` (the one place a rule's needs are set;
    a profile's set-threads / set-resources still override them)."""
    return {**config["resources"]["default"], **config["resources"].get(name, {})}


def rule_threads(name):
    """A rule's `threads:` (config `cpus`)."""
    return configured_resources(name)["cpus"]


def rule_resources(name):
    """A rule's `resources:` (`resources: **rule_resources(name)`): everything configured but cpus."""
    return {
        key: value for key, value in configured_resources(name).items() if key != "cpus"
    }


def experiment_cells(name):
    """Every run of the experiment grid `experiments.<name>`: one dict per model, init, beam,
    epochs, seed and geometry of each `cells` entry (lists multiply out), with its eval.json path.
    """
    grids = config.get("experiments", {})
    if name not in grids:
        raise ValueError(
            f"no experiment grid {name!r} in config.yaml experiments ({sorted(grids)})"
        )
    grid, quantization = grids[name], config["quantization"]
    default_epochs = quantization["max_epochs"]
    cells = {}
    for entry in grid["cells"]:
        for model, init, beam, epochs, seed, geometry in itertools.product(
            entry.get("models", grid["models"]),
            entry["inits"],
            entry["beams"],
            entry.get("epochs", [default_epochs]),
            entry.get("seeds", [quantization["seed"]]),
            entry.get("geometries", [None]),
        ):
            target = {
                "model": model,
                "bpp": entry["bpp"],
                "init": init,
                "beam": beam,
                "seed": seed,
                "geometry": geometry,
            }
            # the default epoch budget stays out of the path (b8, as the default targets have it)
            if epochs != default_epochs:
                target["epochs"] = epochs
            path = target_eval(target)
            cells[path] = {
                **target,
                "max_epochs": epochs,
                "eval_json": path,
            }  # a cell listed twice runs once
    return list(cells.values())


def experiment_models(name):
    """The models of a grid's cells in order of first appearance (the grid's `models`, then those
    entries name): each has its own domain distances and its own rows of the claims."""
    return list(dict.fromkeys(cell["model"] for cell in experiment_cells(name)))


def experiment_domains(name):
    """The evaluation domains of a grid's tables as `domains` of the grid orders them; [] when it
    names none: paper-tables then orders the model's evaluation domains by their measured distance
    from the calibration text (rule domain_distances)."""
    return list(config["experiments"][name].get("domains") or [])


def experiment_evals(name):
    return [cell["eval_json"] for cell in experiment_cells(name)]


# each listed variant's folder (its eval.json path without the file name) -> its priority: the
# first the highest
CELL_RANK = {
    os.path.dirname(path): len(config["execution"]["cell_order"]) - index
    for index, path in enumerate(config["execution"]["cell_order"])
}


def cell_priority(wildcards):
    """A variant job's scheduling priority: cells named in `execution.cell_order` get theirs in that
    order, every other cell 0. Every job of a cell has its cell's priority, so a listed cell's
    stitch, PV-tuning and evaluations start as soon as its layers are done, ahead of the next
    cell's layer jobs, and cells finish one after another instead of all at the end.
    """
    return CELL_RANK.get(
        f"results/{wildcards.model}/{wildcards.bpp}bpp/{wildcards.init}/{wildcards.variant}",
        0,
    )


def model_priority(wildcards):
    """A model's shared jobs (fetch, calibration) take the priority of its first cell in
    `execution.cell_order`: every cell of the model waits on them, so they must not queue behind
    other models' layer jobs (0 when none of its cells is listed)."""
    return max(
        (
            rank
            for cell, rank in CELL_RANK.items()
            if cell.split("/")[1] == wildcards.model
        ),
        default=0,
    )
