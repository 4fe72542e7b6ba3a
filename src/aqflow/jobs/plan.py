"""What the Snakefile computes from a validated config while it builds the DAG: checks that refuse
an impossible configuration or target by name before any job runs, the settings each rule passes
as params, how jobs run (`Execution`), the variant grammar that names a run by its path, the
targets and experiment grids, per-rule resources and scheduling priorities.

workflow/rules/common.smk makes one `WorkflowPlan(config)` and only wires it to rules; paths of
rule outputs stay spelled in the rules. Pure Python (no torch, no pandas), tested without
Snakemake. What a job makes of its rule's params is `aqflow.jobs.workflow_glue`'s.

Params are compared by Snakemake to decide reruns (their repr, for builtin values), so every
settings dict a rule passes keeps its keys sorted (`canonical`), and a setting added after results
were made enters the params only where it differs from what those results had.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from aqflow.data.corpus_catalog import BUILTIN_CORPORA, check_role, evaluation_protocol, model_text_world, text_choice
from aqflow.models.dimensions import first_undivided, linear_widths
from aqflow.models.entries import ModelEntry, entry_problems, fetch_model_request, parse_model_entry

INITS = ("greedy", "oaem", "oaem-patient")
# folders of results/ that are not models: published results (committed, written by hand only),
# the report and the experiment tables
RESERVED_RESULT_FOLDERS = ("published", "report", "paper")
VARIANT_FOLDER = "results/{model}/{bpp}bpp/{init}/{variant}"
VARIANT_WILDCARDS = ("model", "bpp", "init", "variant")
# The variant grammar: the path segment that names one quantization run of a model at a bit rate.
# A geometry prefix replaces the bit rate's codebook layout (a rho sweep at one bit rate), `e` the
# configured epoch budget, `s` the configured seed. VARIANT_REGEX is its one spelling: the
# Snakefile's wildcard constraint and parse_variant both use it. Its groups: group size, codebooks,
# codewords, beam, epochs, seed (unnamed: Snakemake wraps a constraint in a group named after its
# wildcard).
VARIANT_REGEX = r"(?:g(\d+)m(\d+)k(\d+)-)?b(\d+)(?:e(\d+))?(?:s(\d+))?"
VARIANT_FORM = "[g<group>m<codebooks>k<codewords>-]b<beam>[e<epochs>][s<seed>]"
# pvtune keys that are no param of the rule: the switch, the corpus (an input), and how often the
# state is saved (it changes no result: Execution)
PVTUNE_NOT_SETTINGS = ("enabled", "corpus", "save_state_every")
# what the calibrate and calibrate-block stages take of config `calibration` (keys left out: the
# stages' defaults)
CALIBRATE_KEYS = ("num_windows", "window_tokens", "seed", "propagation", "batch_size")
CALIBRATE_BLOCK_KEYS = ("batch_size",)


def parse_variant(variant: str) -> dict[str, int]:
    """ "b8" -> {beam_size: 8}; "g6m2k64-b8e5s43" -> {group_size: 6, num_codebooks: 2, nbits: 6,
    beam_size: 8, max_epochs: 5, seed: 43}: the QuantizerSettings fields the path sets."""
    match = re.fullmatch(VARIANT_REGEX, variant)
    if match is None:
        raise ValueError(f"variant {variant!r} is not {VARIANT_FORM}")
    group, codebooks, codewords, beam, epochs, seed = match.groups()
    settings = {"beam_size": int(beam)}
    if group:
        codewords = int(codewords)
        if codewords < 2 or codewords & (codewords - 1):
            raise ValueError(f"variant {variant!r}: k{codewords} codewords must be a power of two")
        settings.update(group_size=int(group), num_codebooks=int(codebooks), nbits=codewords.bit_length() - 1)
    if epochs:
        settings["max_epochs"] = int(epochs)
    if seed:
        settings["seed"] = int(seed)
    return settings


def geometry_name(group_size: int, num_codebooks: int | None, nbits: int) -> str:
    """8, 2, 8 -> "g8m2k256" (as in variant paths)."""
    return f"g{group_size}m{num_codebooks}k{1 << nbits}"


def variant_name(beam: int, epochs: int | None = None, seed: int | None = None, geometry: str | None = None,
                 default_seed: int | None = None, default_geometry: str | None = None) -> str:
    """The inverse of parse_variant. A seed or geometry equal to the configuration's default
    (`default_seed`, `default_geometry`) stays implicit, so that a grid reuses the default targets'
    runs; epochs are written whenever given, as targets always have been."""
    name = f"b{beam}"
    if epochs is not None:
        name += f"e{epochs}"
    if seed is not None and seed != default_seed:
        name += f"s{seed}"
    return f"{geometry}-{name}" if geometry and geometry != default_geometry else name


EVALUATE_OPTION = {"stage": "evaluate"}  # an Execution field that is also an evaluate stage setting
PVTUNE_OPTION = {"stage": "pvtune"}  # ... and one that is a pvtune stage setting


@dataclass(frozen=True)
class Execution:
    """How jobs run, not what they compute: config `execution`, and `pvtune.save_state_every`.

    Rules pass it whole as a param: Snakemake's rerun check compares only params of builtin types,
    so it reaches the job (`aqflow.jobs.workflow_glue`) without a changed value rerunning finished
    jobs."""

    warm_workers: bool | str  # true, false or "auto" (aqflow.jobs.warm_workers.wanted)
    warm_worker_idle_seconds: float
    # the evaluation's own settings of the same names (stage_options("evaluate")): the most logits
    # one forward pass holds, and how it computes AQLM layers on a CPU / a GPU
    logits_budget_gib: float = field(metadata=EVALUATE_OPTION)
    cell_order: tuple[str, ...]
    save_state_every: int | None = field(metadata=PVTUNE_OPTION)  # None: PV-tuning not configured
    cpu_kernel: str = field(default="fast", metadata=EVALUATE_OPTION)
    gpu_kernel: str = field(default="dense", metadata=EVALUATE_OPTION)
    # how long a PV-tuning job waits for its card's memory when other jobs hold it
    memory_wait_seconds: float = field(default=300, metadata=PVTUNE_OPTION)

    def stage_options(self, stage: str) -> dict:
        """The fields marked as `stage`'s settings, by name: passed to that stage unrenamed."""
        return {spec.name: getattr(self, spec.name) for spec in fields(self) if spec.metadata.get("stage") == stage}

    @classmethod
    def from_config(cls, config: Mapping) -> "Execution":
        section = config["execution"]
        return cls(warm_workers=section["warm_workers"], warm_worker_idle_seconds=section["warm_worker_idle_seconds"],
                   logits_budget_gib=section["logits_budget_gib"], cell_order=tuple(section["cell_order"]),
                   save_state_every=(config.get("pvtune") or {}).get("save_state_every"),
                   cpu_kernel=section["cpu_kernel"], gpu_kernel=section["gpu_kernel"],
                   memory_wait_seconds=section["pvtune_memory_wait_seconds"])


def canonical(mapping: Mapping) -> dict:
    """A settings dict with sorted keys: Snakemake compares params as written, so the same settings
    in another key order would otherwise look changed and rerun jobs."""
    return {key: mapping[key] for key in sorted(mapping)}


def wildcard_values(wildcards: Any) -> dict:
    """A job's wildcards (Snakemake's, a namespace or a mapping) as a dict."""
    if isinstance(wildcards, Mapping):
        return dict(wildcards)
    if hasattr(wildcards, "items"):
        return dict(wildcards.items())
    return dict(vars(wildcards))


class WorkflowPlan:
    """The plan of one validated config (Snakemake has filled in the schema's defaults)."""

    def __init__(self, config: Mapping, model_folder: Callable[[str], str] = "resources/models/{}".format):
        """`model_folder`: where fetch-model writes a model (the fetch rule's output, given by name)."""
        self.config = config
        self.model_folder = model_folder
        self.calibration = config["calibration"]
        self.quantization = config["quantization"]
        # which corpus each role reads, per text world ("hub": WikiText-2/C4 from the hub;
        # "offline": the registry stand-ins); user corpora are local files
        self.text = text_choice(config.get("text"))
        self.user_corpora = config.get("corpora") or {}
        self.check_text()
        self.sequential = self.calibration["propagation"] == "sequential"
        self.block_finetune = dict(self.calibration.get("block_finetune") or {})
        self.finetune = bool(self.block_finetune.pop("enabled", False))
        if self.finetune and not self.sequential:
            raise ValueError("calibration.block_finetune.enabled needs calibration.propagation: sequential "
                             "(in fp mode every block is calibrated from the full-precision model)")
        self.pvtune = config.get("pvtune", {"enabled": False})
        self.pv_enabled = self.pvtune["enabled"]
        self.speed = config.get("speed") or {}
        # with speed on, `snakemake` and the report ask for every target's and baseline's speed.json
        self.speed_enabled = bool(self.speed.get("enabled", False))
        reserved = sorted(set(config["models"]) & set(RESERVED_RESULT_FOLDERS))
        if reserved:
            raise ValueError(f"config.yaml models: {reserved} are folders of results/ "
                             f"({list(RESERVED_RESULT_FOLDERS)}); give the model another name")
        # every `models:` entry parsed (a bad entry is an error naming it before anything runs)
        self.model_entries = {name: parse_model_entry(name, entry) for name, entry in config["models"].items()}
        self._checked_models: dict[str, ModelEntry] = {}
        self._widths: dict[str, tuple | None] = {}
        # how jobs run: a param of the rules whose jobs read it, which Snakemake does not compare
        self.execution = Execution.from_config(config)
        # each listed variant's folder -> its priority: the first the highest
        order = self.execution.cell_order
        self.cell_rank = {os.path.dirname(path): len(order) - index for index, path in enumerate(order)}

    # --- text -------------------------------------------------------------------------------------

    def check_text(self) -> None:
        """Refuse, before any job runs, a corpus that does not exist or cannot serve its role."""
        clashes = sorted(set(self.user_corpora) & set(BUILTIN_CORPORA))
        if clashes:
            raise ValueError(f"corpora: {clashes} are built-in corpus names; give user corpora other names")
        for world, roles in self.text.items():
            for role, names in (("calibration", [roles["calibration"]]), ("pvtune", [roles["pvtune"]]),
                                ("evaluation", roles["evaluation"])):
                for name in names:
                    try:
                        check_role(name, role, self.user_corpora)
                    except (KeyError, ValueError) as error:
                        raise ValueError(f"text.{world}.{role}: {error}") from None

    def model_text(self, model: str) -> str:
        """ "hub" or "offline": the text world of a model (models.<name>.text picks it explicitly;
        otherwise hub presets and hub_id entries read hub text, the others the stand-ins)."""
        if model not in self.config["models"]:
            raise ValueError(f"model {model!r} is not in config.yaml models ({sorted(self.config['models'])})")
        return model_text_world(self.config["models"][model])

    def text_corpus(self, model: str, role: str) -> str:
        """The corpus a model's `role` (calibration or pvtune) reads."""
        return self.text[self.model_text(model)][role]

    def evaluation_domains(self, model: str) -> list[list[str]]:
        """[[domain, protocol], ...]: the perplexity domains a model is evaluated on, each a corpus."""
        return [[name, evaluation_protocol(name, self.user_corpora)] for name in self.text[self.model_text(model)]["evaluation"]]

    def domains(self, wildcards) -> list[list[str]]:
        """evaluation_domains of a job's model."""
        return self.evaluation_domains(wildcards.model)

    def user_corpus(self, wildcards) -> dict:
        """The config entry of a job's user corpus (an empty dict for built-in corpora)."""
        return self.user_corpora.get(wildcards.corpus, {})

    def calibration_fraction(self, wildcards) -> float:
        """The share of a corpus's documents given to calibration: its own, else `data`'s."""
        return self.user_corpus(wildcards).get("calibration_fraction", self.config["data"]["calibration_fraction"])

    # --- settings a rule passes -------------------------------------------------------------------

    def calibration_id(self, model: str) -> str:
        """The calibration's folder name: every setting that changes its XᵀX, the corpus first."""
        c = self.calibration
        return (f"{self.text_corpus(model, 'calibration')}-n{c['num_windows']}-t{c['window_tokens']}"
                f"-s{c['seed']}-{c['propagation']}")

    def calibrate_settings(self) -> dict:
        return canonical({key: self.calibration[key] for key in CALIBRATE_KEYS if key in self.calibration})

    def calibrate_block_settings(self) -> dict:
        return canonical({key: self.calibration[key] for key in CALIBRATE_BLOCK_KEYS if key in self.calibration})

    def calibration_record(self, wildcards) -> dict:
        """The calibration settings a variant's eval.json records, with the corpus the model read."""
        settings = {key: canonical(value) if isinstance(value, dict) else value for key, value in self.calibration.items()}
        return canonical({**canonical(settings), "corpus": self.text_corpus(wildcards.model, "calibration")})

    def evaluation_settings(self) -> dict:
        return canonical(self.config["evaluation"])

    def pvtune_settings(self) -> dict:
        """Every PV-tuning setting of the config but those of PVTUNE_NOT_SETTINGS; keys left out take
        the stage's defaults (config.yaml's)."""
        return canonical({key: value for key, value in self.pvtune.items() if key not in PVTUNE_NOT_SETTINGS})

    def speed_settings(self) -> dict:
        """Every setting of config `speed` but the switch: a changed one reruns the speed jobs."""
        return canonical({key: value for key, value in self.speed.items() if key != "enabled"})

    def bitrate(self, bpp) -> dict:
        rates = {str(key): value for key, value in self.config["bitrates"].items()}
        if str(bpp) not in rates:
            raise ValueError(f"{bpp} bpp is not in config bitrates ({sorted(self.config['bitrates'])})")
        return rates[str(bpp)]

    def quantizer_settings(self, wildcards) -> dict:
        """Every QuantizerSettings field a layer job uses: config defaults, overridden by the path
        (bit rate, then the variant's geometry, beam, epochs and seed)."""
        settings = dict(self.quantization)
        settings.update(self.bitrate(wildcards.bpp))
        settings["init"] = wildcards.init
        from_path = parse_variant(wildcards.variant)
        settings.update(from_path)
        code_bits = settings["num_codebooks"] * settings["nbits"] / settings["group_size"]
        # a geometry must store the bit rate of its folder (the configured bit rates may round: the
        # tiny test model's "2" stores 1.5)
        if "group_size" in from_path and code_bits != float(wildcards.bpp):
            raise ValueError(f"variant {wildcards.variant!r} stores {code_bits:g} code bits per weight "
                             f"(codebooks x log2(codewords) / group size), not the {wildcards.bpp} of its "
                             f"{wildcards.bpp}bpp folder")
        return canonical(settings)

    def quantizer_setting(self, key: str) -> Callable:
        """A param function: one field of a job's quantizer_settings."""
        def setting(wildcards):
            return self.quantizer_settings(wildcards)[key]
        return setting

    def fetch_model_settings(self, wildcards) -> dict:
        """What fetch-model is asked for a model (its settings' values, and `path` for a folder)."""
        return fetch_model_request(self.checked_model(wildcards.model), self.quantization["group_size"])

    # --- checks while the DAG is built ------------------------------------------------------------

    def checked_model(self, name: str) -> ModelEntry:
        """The entry of model `name`, refused by name if config.json already shows the pipeline cannot
        quantize it (a local folder, or a hub model the hub cache holds): before any job runs."""
        if name not in self._checked_models:
            if name not in self.model_entries:
                raise ValueError(f"model {name!r} is not in config.yaml models ({sorted(self.model_entries)})")
            problems = entry_problems(self.model_entries[name], self.quantization["group_size"])
            if problems:
                raise ValueError(f"model {name!r} cannot be quantized by this pipeline: " + "; ".join(problems))
            self._checked_models[name] = self.model_entries[name]
        return self._checked_models[name]

    def check_wildcards(self, wildcards) -> None:
        """Refuse an impossible target while the DAG is built (`snakemake -n` included), naming the
        wildcard and its allowed values, instead of failing in a job hours later."""
        given = wildcard_values(wildcards)
        allowed = {  # wildcard -> (where its values come from, the values)
            "model": ("config models", sorted(self.config["models"])),
            "bpp": ("config bitrates", sorted(str(key) for key in self.config["bitrates"])),
            "init": ("the known inits", list(INITS)),
        }
        for name, (where, values) in allowed.items():
            if name in given and str(given[name]) not in values:
                raise ValueError(f"wildcard {name}={given[name]!r} is not one of {where}: allowed {values}")
        if "variant" in given:
            settings = parse_variant(given["variant"])
            if settings["beam_size"] < 1 or settings.get("max_epochs", 1) < 1:
                raise ValueError(f"wildcard variant={given['variant']!r}: beam and epochs must be >= 1 "
                                 f"({VARIANT_FORM}, e.g. b8 or b8e20s43)")

    def check_model(self, wildcards) -> None:
        """A job's wildcards and its model's entry checked (see check_wildcards, checked_model)."""
        self.check_wildcards(wildcards)
        self.checked_model(wildcards.model)

    def check_geometry(self, wildcards) -> None:
        """Refuse a variant whose quantization group size does not divide the input width of one of
        its model's layers, naming model, geometry and the first such layer (a layer job would fail
        on it hours later). Unknown widths (a hub model not yet fetched nor cached) pass."""
        settings = self.quantizer_settings(wildcards)
        model, group = wildcards.model, settings["group_size"]
        if model not in self._widths:
            self._widths[model] = linear_widths(self.checked_model(model), self.model_folder(model))
        if self._widths[model] is None:
            return
        widths, where = self._widths[model]
        undivided = first_undivided(widths, group)
        if undivided:
            geometry = geometry_name(group, settings["num_codebooks"], settings["nbits"])
            raise ValueError(f"model {model!r}, variant {wildcards.variant!r}: geometry {geometry} (group size {group}) "
                             f"does not divide the {undivided[1]} inputs of {undivided[0]} (widths from {where}); "
                             f"a code covers group-size consecutive inputs of every layer")

    def check_geometries(self) -> None:
        """check_geometry for every target of the config and every cell of its experiment grids."""
        variants = self.targets() + [self.target_wildcards(cell) for name in self.config.get("experiments", {})
                                     for cell in self.experiment_cells(name)]
        for variant in variants:
            self.check_geometry(SimpleNamespace(**variant))

    def variant_folder(self, wildcards) -> str:
        """The folder of a variant, its wildcards and settings checked first (input functions call this
        while the DAG is built, so an impossible target, bit rate or geometry fails `snakemake -n` by name)."""
        self.check_wildcards(wildcards)
        self.check_geometry(wildcards)
        return VARIANT_FOLDER.format(**variant_wildcards(wildcards))

    # --- labels of evaluations --------------------------------------------------------------------

    def variant_label(self, wildcards) -> str:
        return "{model}/{bpp}bpp/{init}/{variant}".format(**variant_wildcards(wildcards))

    def pvtuned_label(self, wildcards) -> str:
        return self.variant_label(wildcards) + "+pv"

    @staticmethod
    def fp_label(wildcards) -> str:
        return f"{wildcards.model}/fp"

    # --- targets and grids ------------------------------------------------------------------------

    def target_wildcards(self, target: Mapping) -> dict:
        """A target of config.yaml (or a grid cell) -> the wildcards of its variant's jobs."""
        rate = {str(key): value for key, value in self.config["bitrates"].items()}.get(str(target["bpp"]), {})
        default_geometry = geometry_name(self.quantization["group_size"], rate.get("num_codebooks"), rate.get("nbits", 0))
        name = variant_name(target["beam"], target.get("epochs"), target.get("seed"), target.get("geometry"),
                            default_seed=self.quantization["seed"], default_geometry=default_geometry)
        return {"model": target["model"], "bpp": target["bpp"], "init": target["init"], "variant": name}

    def targets(self) -> list[dict]:
        """The wildcards of every target variant of config.yaml."""
        return [self.target_wildcards(target) for target in self.config["targets"]]

    @staticmethod
    def final_eval(variant: Mapping) -> str:
        """A variant's final eval.json (the PV-tuned model's when PV-tuning is on)."""
        return VARIANT_FOLDER.format(**variant) + "/eval.json"

    @property
    def pre_pv_eval_name(self) -> str:
        """The stitched model's own evaluation: with PV-tuning on, eval.json is the PV-tuned model's
        (the pre-PV one embedded) and this one is written beside it; else it is eval.json."""
        return "eval_pre_pv.json" if self.pv_enabled else "eval.json"

    def pre_pv_eval(self, variant: Mapping) -> str:
        """A variant's evaluation before PV-tuning (pre_pv_eval_name in its folder)."""
        return VARIANT_FOLDER.format(**variant) + "/" + self.pre_pv_eval_name

    def target_models(self) -> list[str]:
        return sorted({target["model"] for target in self.config["targets"]})

    def report_jobs(self, layers: Callable[[Any], list[str]], blocks: Callable[[Any], int]) -> list[tuple[str, dict]]:
        """(rule, wildcards) of every job behind the report, whose benchmark files it reads: the
        fetches, calibrations and fp evaluations (and speed jobs) of the targets' models, and each
        target variant's jobs (its layers, sequential blocks, stitch, PV-tuning, evaluations, speed). `layers` and
        `blocks` give a variant's layer names and block count (the calibration checkpoint's)."""
        jobs, corpora = [], set()
        for model in self.target_models():
            corpora.add(self.text_corpus(model, "calibration"))
            corpora.update(name for name, _ in self.evaluation_domains(model))
            if self.pv_enabled:
                corpora.add(self.text_corpus(model, "pvtune"))
            jobs += [("fetch_model", {"model": model}),
                     ("calibrate", {"model": model, "calib": self.calibration_id(model)}),
                     ("evaluate_fp", {"model": model})]
            if self.speed_enabled:
                jobs.append(("speed_fp", {"model": model}))
        jobs += [("fetch_data", {"corpus": name}) for name in sorted(corpora)]
        for variant in self.targets():
            wildcards = SimpleNamespace(**variant)  # as input functions read a job's
            count = blocks(wildcards)
            jobs += [("quantize_layer", {**variant, "layer": layer}) for layer in layers(wildcards)]
            if self.sequential:  # block 0 reads the shared calibration
                jobs += [("calibrate_block", {**variant, "block": block}) for block in range(1, count)]
            if self.finetune:
                jobs += [("finetune_block", {**variant, "block": block}) for block in range(count)]
            finals = ["stitch", "evaluate_quantized"] + (["pvtune", "evaluate_pvtuned"] if self.pv_enabled else [])
            finals += ["speed"] if self.speed_enabled else []
            jobs += [(rule, variant) for rule in finals]
        return jobs

    def experiment_grid(self, name: str) -> dict:
        grids = self.config.get("experiments", {})
        if name not in grids:
            raise ValueError(f"no experiment grid {name!r} in config.yaml experiments ({sorted(grids)})")
        return grids[name]

    def cells_source(self, name: str) -> str:
        """The folder grid `name` reads its cells from: results (built as needed) or its
        `cells_from`, e.g. results/published (finished cells, read as they are, never rebuilt)."""
        return self.experiment_grid(name).get("cells_from", "results").rstrip("/")

    def experiment_file(self, name: str, path: str) -> str:
        """Where grid `name` reads `path`, a file the pipeline writes under results/ (a cell's
        eval.json, a model's domains.json): the same path under the grid's cells_source."""
        return self.cells_source(name) + path.removeprefix("results")

    def experiment_cells(self, name: str) -> list[dict]:
        """Every run of the experiment grid `experiments.<name>`: one dict per model, init, beam,
        epochs, seed and geometry of each `cells` entry (lists multiply out), with its eval.json path
        (the evaluation before PV-tuning for entries with `pv: false`; under `cells_from` if set)."""
        grid, default_epochs = self.experiment_grid(name), self.quantization["max_epochs"]
        cells = {}
        for entry in grid["cells"]:
            for model, init, beam, epochs, seed, geometry in itertools.product(
                    entry.get("models", grid["models"]), entry["inits"], entry["beams"],
                    entry.get("epochs", [default_epochs]), entry.get("seeds", [self.quantization["seed"]]),
                    entry.get("geometries", [None])):
                target = {"model": model, "bpp": entry["bpp"], "init": init, "beam": beam, "seed": seed,
                          "geometry": geometry}
                # the default epoch budget stays out of the path (b8, as the default targets have it)
                if epochs != default_epochs:
                    target["epochs"] = epochs
                variant = self.target_wildcards(target)
                evaluation = self.final_eval(variant) if entry.get("pv", True) else self.pre_pv_eval(variant)
                path = self.experiment_file(name, evaluation)
                cells[path] = {**target, "max_epochs": epochs, "eval_json": path}  # a cell listed twice runs once
        return list(cells.values())

    def experiment_evals(self, name: str) -> list[str]:
        """The grid's eval.json files to build; under `cells_from`, those that exist there (the
        tables list the others as missing: nothing is built)."""
        paths = [cell["eval_json"] for cell in self.experiment_cells(name)]
        return paths if self.cells_source(name) == "results" else [path for path in paths if os.path.isfile(path)]

    def experiment_models(self, name: str) -> list[str]:
        """The models of a grid's cells in order of first appearance (the grid's `models`, then those
        entries name): each has its own domain distances and its own rows of the claims."""
        return list(dict.fromkeys(cell["model"] for cell in self.experiment_cells(name)))

    def experiment_domains(self, name: str) -> list[str]:
        """The evaluation domains of a grid's tables as `domains` of the grid orders them; [] when it
        names none: paper-tables then orders the model's evaluation domains by their measured distance
        from the calibration text (rule domain_distances)."""
        return list(self.experiment_grid(name).get("domains") or [])

    # --- resources and scheduling -----------------------------------------------------------------

    def configured_resources(self, rule: str) -> dict:
        """config `resources.<rule>` over `resources.default` (the one place a rule's needs are set;
        a profile's set-threads / set-resources still override them)."""
        return {**self.config["resources"]["default"], **self.config["resources"].get(rule, {})}

    def threads(self, rule: str) -> int:
        """A rule's `threads:` (config `cpus`)."""
        return self.configured_resources(rule)["cpus"]

    def resources(self, rule: str) -> dict:
        """A rule's `resources:` (`resources: **PLAN.resources(rule)`): everything configured but cpus."""
        return {key: value for key, value in self.configured_resources(rule).items() if key != "cpus"}

    def cell_priority(self, wildcards) -> int:
        """A variant job's scheduling priority: cells named in `execution.cell_order` get theirs in that
        order, every other cell 0. Every job of a cell has its cell's priority, so a listed cell's
        stitch, PV-tuning and evaluations start as soon as its layers are done, ahead of the next
        cell's layer jobs, and cells finish one after another instead of all at the end."""
        return self.cell_rank.get(VARIANT_FOLDER.format(**variant_wildcards(wildcards)), 0)

    def model_priority(self, wildcards) -> int:
        """A model's shared jobs (fetch, calibration) take the priority of its first cell in
        `execution.cell_order`: every cell of the model waits on them, so they must not queue behind
        other models' layer jobs (0 when none of its cells is listed)."""
        return max((rank for cell, rank in self.cell_rank.items() if cell.split("/")[1] == wildcards.model), default=0)


def variant_wildcards(wildcards) -> dict:
    """The four wildcards that name a variant (of any job's wildcards, or a target's)."""
    values = wildcard_values(wildcards)
    return {name: values[name] for name in VARIANT_WILDCARDS}
