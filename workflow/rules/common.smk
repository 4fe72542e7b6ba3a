# Wiring: the plan of the config (aqflow.jobs.plan: checks, settings, targets, grids, resources,
# priorities) and the input functions that spell a job's paths through the rules' outputs.
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from snakemake.exceptions import IncompleteCheckpointException

# the library's pure-Python planning (no torch), whether or not aqflow is installed here
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from aqflow.io.integrity import DigestCache
from aqflow.jobs.currency import InputGuard, WorkflowGuard, digest_cache_path
from aqflow.jobs.plan import VARIANT_REGEX, WorkflowPlan, variant_wildcards


wildcard_constraints:
    model="[^/]+",
    bpp=r"\d+",
    # any name: an unknown init is refused by PLAN.check_wildcards, naming the known ones
    init="[^/]+",
    variant=VARIANT_REGEX,
    layer="[^/]+",
    corpus="[^/]+",
    block=r"\d+",


def output_path(pattern, **wildcards):
    """One file of a rule's output pattern (`rules.<rule>.output.<name>`) with its wildcards filled
    in: the rule that writes a file is the one place its path is spelled."""
    return pattern.format(**wildcards)


def fetched_model(model):
    """The folder fetch_model writes for `model`."""
    return output_path(rules.fetch_model.output[0], model=model)


PLAN = WorkflowPlan(config, model_folder=fetched_model)
PRE_PV_EVAL = PLAN.pre_pv_eval_name


# Every input of every job is checked while the DAG is built (aqflow.jobs.currency), by the main
# Snakemake process: a corrupt artifact stops the build by name; a missing one whose consumer's
# results exist, or a folder lacking a listed file, is rebuilt (its job forced) with what follows.
GUARD = WorkflowGuard(
    InputGuard(DigestCache(digest_cache_path())), workflow, rules, output_path
)
current = GUARD.inputs


onstart:
    GUARD.started = True


def variant_output(pattern, wildcards, **more):
    """A file of one of a variant's jobs, the variant's wildcards and settings checked first."""
    PLAN.variant_folder(wildcards)
    return output_path(pattern, **variant_wildcards(wildcards), **more)


def variant_file(name):
    """The wildcard pattern of a file in a variant's folder."""
    return f"results/{{model}}/{{bpp}}bpp/{{init}}/{{variant}}/{name}"


def model_dir(wildcards):
    PLAN.check_model(wildcards)
    return fetched_model(wildcards.model)


def corpus_path(name):
    return output_path(rules.fetch_data.output.corpus, corpus=name)


def user_corpus_file(wildcards):
    """A user corpus's file (an input of fetch_data, so editing it refetches); none for built-ins."""
    entry = PLAN.user_corpus(wildcards)
    return [entry["path"]] if entry else []


def calibration_corpus(wildcards):
    return corpus_path(PLAN.text_corpus(wildcards.model, "calibration"))


def pvtune_corpus(wildcards):
    return corpus_path(PLAN.text_corpus(wildcards.model, "pvtune"))


def evaluation_corpora(wildcards):
    return [corpus_path(name) for name, _ in PLAN.domains(wildcards)]


def calibration_dir(wildcards):
    calib = PLAN.calibration_id(wildcards.model)
    return output_path(rules.calibrate.output[0], model=wildcards.model, calib=calib)


def calibration_found(wildcards):
    """calibration.json of the model's calibration (a checkpoint): its layers and block count."""
    calib = PLAN.calibration_id(wildcards.model)
    folder = checkpoints.calibrate.get(model=wildcards.model, calib=calib).output[0]
    record = Path(folder) / "calibration.json"
    # a folder that lost its record is calibrated again (GUARD forces it) before anyone reads it
    if not record.is_file():
        raise IncompleteCheckpointException(checkpoints.calibrate.rule, folder)
    return json.loads(record.read_text())


def quantized_layers(wildcards):
    """Module names of the linears to quantize, as the calibration found them."""
    return calibration_found(wildcards)["layers"]


def num_blocks(wildcards):
    return calibration_found(wildcards)["blocks"]


def layer_files(wildcards, pattern):
    """One file per quantized layer of a variant (`pattern`: a quantize_layer output)."""
    PLAN.variant_folder(wildcards)  # checked before the calibration is looked up
    variant = variant_wildcards(wildcards)
    names = quantized_layers(wildcards)
    return [output_path(pattern, **variant, layer=name) for name in names]


def layer_artifacts(wildcards):
    return layer_files(wildcards, rules.quantize_layer.output.layer)


def layer_metrics(wildcards):
    return layer_files(wildcards, rules.quantize_layer.output.metrics)


def pvtune_state_dir(wildcards):
    """Where PV-tuning saves its state (beside its outputs, not among them: Snakemake deletes a
    failed job's outputs, not this, so a rerun resumes)."""
    metrics = output_path(rules.pvtune.output.metrics, **variant_wildcards(wildcards))
    return str(Path(metrics).parent / "state")


def checked_pvtune_state(wildcards):
    """No input: the state a PV-tuning job would resume from, refused while the DAG is built if
    damaged (the advice: delete it; PV-tuning then starts from step 0)."""
    return GUARD.state(pvtune_state_dir(wildcards), "PV-tuning")


def target_evals():
    return [PLAN.final_eval(variant) for variant in PLAN.targets()]


def baseline_evals():
    pattern = rules.evaluate_fp.output[0]
    return sorted({output_path(pattern, model=t["model"]) for t in config["targets"]})


def speed_files():
    """speed.json of every target variant and of its baseline (none with speed off)."""
    if not PLAN.speed_enabled:
        return []
    variants = [output_path(rules.speed.output[0], **v) for v in PLAN.targets()]
    fp = rules.speed_fp.output[0]
    return variants + [output_path(fp, model=m) for m in PLAN.target_models()]


def pv_train_logs():
    """The PV-tuning training logs of the target variants (none when PV-tuning is off)."""
    if not PLAN.pv_enabled:
        return []
    pattern = rules.pvtune.output.train_log
    return [output_path(pattern, **variant) for variant in PLAN.targets()]


def all_targets(wildcards):
    """Every target variant's eval.json (and speed.json), the baselines, the report, and every layer artifact:
    Snakemake regenerates a deleted file only when it is requested, so listing the layers here
    makes a deleted layer rerun (with what follows it) on the next plain `snakemake`."""
    layers = []
    for variant in PLAN.targets():
        layers += layer_artifacts(SimpleNamespace(**variant))
    summary = [rules.report.output.table]
    return target_evals() + baseline_evals() + speed_files() + summary + layers


def target_calibrations(wildcards):
    """The calibration folders (checkpoint outputs) of the targets' models: the report's job list
    (`job_benchmarks`) reads which layers they found."""
    return [calibration_dir(SimpleNamespace(model=m)) for m in PLAN.target_models()]


def job_benchmarks(wildcards):
    """The benchmark file of every job behind the report (each is an output of its job)."""
    jobs = PLAN.report_jobs(quantized_layers, num_blocks)
    return [output_path(getattr(rules, rule).benchmark, **wcs) for rule, wcs in jobs]
