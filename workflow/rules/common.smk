# Wiring: the plan of the config (aqflow.jobs.plan: checks, settings, targets, grids, resources,
# priorities) and the input functions that spell a job's paths through the rules' outputs.
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from snakemake.exceptions import IncompleteCheckpointException

# the library's pure-Python planning (no torch), whether or not aqflow is installed here
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from aqflow.io.integrity import DigestCache
from aqflow.jobs.currency import InputGuard, digest_cache_path
from aqflow.jobs.plan import WorkflowPlan, variant_wildcards, wildcard_values
from aqflow.jobs.stage_settings import Execution
from aqflow.jobs.variants import VARIANT_REGEX
from aqflow.models.folder import block_index


wildcard_constraints:
    model="[^/]+",
    bpp=r"\d+",
    # any name: an unknown init is refused by PLAN.check_wildcards, naming the known ones
    init="[^/]+",
    variant=VARIANT_REGEX,
    layer="[^/]+",
    corpus="[^/]+",
    block=r"\d+",


PLAN = WorkflowPlan(
    config,
    model_folder=lambda model: output_path(rules.fetch_model.output[0], model=model),
)
# how jobs run, not what they compute: a param of the rules that read it (reruns nothing)
EXECUTION = Execution.from_config(config)
# With PV-tuning on, eval.json is the PV-tuned model's evaluation (with the pre-PV one embedded)
# and the stitched model's own evaluation is written beside it.
PRE_PV_EVAL = "eval_pre_pv.json" if PLAN.pv_enabled else "eval.json"


# Every input of every job is checked while the DAG is built (aqflow.jobs.currency), by the main
# Snakemake process: a corrupt artifact stops the build by name; a missing one whose consumer's
# results exist, or a folder lacking a listed file, is rebuilt (its job forced) with what follows.
GUARD = InputGuard(DigestCache(digest_cache_path()))
DAG_STATE = {"built": False, "rebuilt": set()}


onstart:
    # jobs start now: a check failing from here on (a checkpoint's dependents re-planned) fails
    # like any input function, instead of ending Snakemake under its running jobs
    DAG_STATE["built"] = True


def act_on(verdict):
    """Carry out a currency verdict in Snakemake's terms (see GUARD)."""
    if verdict is None:
        return
    if verdict.refusal:
        if DAG_STATE["built"]:
            raise ValueError(verdict.refusal)
        # not an Exception: Snakemake would take an input function's error for "no producer" of
        # a file that exists, and go on without the check
        raise SystemExit(f"aqflow: {verdict.refusal}")
    # as Snakemake itself forces jobs with incomplete outputs (--rerun-incomplete)
    workflow.dag.forcefiles.add(verdict.rebuild)
    if verdict.rebuild not in DAG_STATE["rebuilt"]:
        DAG_STATE["rebuilt"].add(verdict.rebuild)
        print(f"aqflow: {verdict.reason}: its job runs again", file=sys.stderr)


def current(rule, source, temporary=False):
    """An input function: the paths of `source` (a path or pattern, a list of them, or an input
    function) for a job of `rule`, each checked by GUARD. `temporary`: inputs removed once used
    (a missing one is expected)."""

    def inputs(wildcards):
        values = wildcard_values(wildcards)

        def outputs():
            return [output_path(p, **values) for p in getattr(rules, rule).output]

        try:
            if callable(source):
                paths = source(wildcards)
            elif isinstance(source, str):
                paths = output_path(source, **values)
            else:
                paths = [output_path(path, **values) for path in source]
        except IncompleteCheckpointException as pending:
            if workflow.is_main_process:
                act_on(GUARD.check(str(pending.targetfile), outputs()))
            raise
        if workflow.is_main_process:
            for path in [paths] if isinstance(paths, str) else paths:
                act_on(GUARD.check(str(path), outputs(), temporary))
            # the job's own finished outputs too: a named target is nobody's input
            for output in outputs():
                if os.path.lexists(output):
                    act_on(GUARD.existing(output))
        return paths

    return inputs


def output_path(pattern, **wildcards):
    """One file of a rule's output pattern (`rules.<rule>.output.<name>`) with its wildcards filled
    in: the rule that writes a file is the one place its path is spelled."""
    return pattern.format(**wildcards)


def variant_output(pattern, wildcards, **more):
    """A file of one of a variant's jobs, the variant's wildcards and settings checked first."""
    PLAN.variant_folder(wildcards)
    return output_path(pattern, **variant_wildcards(wildcards), **more)


def variant_file(name):
    """The wildcard pattern of a file in a variant's folder."""
    return f"results/{{model}}/{{bpp}}bpp/{{init}}/{{variant}}/{name}"


def model_dir(wildcards):
    PLAN.check_model(wildcards)
    return output_path(rules.fetch_model.output[0], model=wildcards.model)


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


def block_layer_artifacts(wildcards, block):
    layers = zip(quantized_layers(wildcards), layer_artifacts(wildcards))
    return [path for layer, path in layers if block_index(layer) == block]


def layer_calibration_dir(wildcards):
    """The XᵀX of a layer's block: shared (fp mode, and block 0 in sequential mode) or, for a block
    after the first in sequential mode, the variant's own (it depends on its quantized blocks).
    """
    block = block_index(wildcards.layer)
    if PLAN.sequential and block > 0:
        pattern = rules.calibrate_block.output.calibration
        return variant_output(pattern, wildcards, block=block)
    return calibration_dir(wildcards)


def tuned_block_dir(wildcards, block):
    return variant_output(rules.finetune_block.output[0], wildcards, block=block)


def block_inputs_path(wildcards, block):
    """Inputs of `block` in the quantized model (a temporary artifact of its calibrate_block job)."""
    return variant_output(rules.calibrate_block.output.inputs, wildcards, block=block)


# block inputs are removed once used (temp), unless kept: a missing one is no lost result
BLOCK_INPUTS_TEMPORARY = not PLAN.calibration.get("keep_block_inputs", False)


def block_inputs_output(path):
    """Block inputs are removed once used (temp), unless calibration.keep_block_inputs: kept, a
    later rerun of block i starts from block i-1's stored inputs instead of recomputing from block 1.
    """
    return temp(path) if BLOCK_INPUTS_TEMPORARY else path


def previous_block_layers(wildcards):
    """What calibrate_block of block i runs: block i-1 as quantized (and tuned, if enabled)."""
    previous = int(wildcards.block) - 1
    if PLAN.finetune:
        return [tuned_block_dir(wildcards, previous)]
    return block_layer_artifacts(wildcards, previous)


def previous_layers_dir(wildcards):
    if PLAN.finetune:
        return tuned_block_dir(wildcards, int(wildcards.block) - 1)
    return f"{PLAN.variant_folder(wildcards)}/layers"


def previous_block_tensors(wildcards):
    previous = int(wildcards.block) - 1
    return (
        f"{tuned_block_dir(wildcards, previous)}/block.safetensors"
        if PLAN.finetune
        else ""
    )


def previous_block_inputs(wildcards):
    previous = int(wildcards.block) - 1
    return [block_inputs_path(wildcards, previous)] if previous >= 1 else []


def block_layers(wildcards):
    return block_layer_artifacts(wildcards, int(wildcards.block))


def finetune_inputs(wildcards):
    """The inputs of the block being tuned; block 0's are the embeddings, recomputed."""
    block = int(wildcards.block)
    return [block_inputs_path(wildcards, block)] if block >= 1 else []


def layers_dir(wildcards):
    return f"{PLAN.variant_folder(wildcards)}/layers"


def finetuned_blocks(wildcards):
    """Every tuned block folder of a variant (none unless block fine-tuning is enabled)."""
    if not PLAN.finetune:
        return []
    return [tuned_block_dir(wildcards, block) for block in range(num_blocks(wildcards))]


def stitch_layers_dirs(wildcards):
    """Where stitch finds the layers: the tuned block folders, or the variant's layers folder."""
    return finetuned_blocks(wildcards) or [layers_dir(wildcards)]


def replaced_block_tensors(wildcards):
    return [f"{folder}/block.safetensors" for folder in finetuned_blocks(wildcards)]


def pvtune_state_dir(wildcards):
    """Where PV-tuning saves its state (beside its outputs, not among them: Snakemake deletes a
    failed job's outputs, not this, so a rerun resumes)."""
    metrics = output_path(rules.pvtune.output.metrics, **variant_wildcards(wildcards))
    return str(Path(metrics).parent / "state")


def checked_pvtune_state(wildcards):
    """No input: the state a PV-tuning job would resume from, refused while the DAG is built if
    damaged (the advice: delete it; PV-tuning then starts from step 0)."""
    if workflow.is_main_process:
        act_on(GUARD.check_state(pvtune_state_dir(wildcards), "PV-tuning"))
    return []


def target_evals():
    return [PLAN.final_eval(variant) for variant in PLAN.targets()]


def baseline_evals():
    pattern = rules.evaluate_fp.output[0]
    return sorted({output_path(pattern, model=t["model"]) for t in config["targets"]})


def pv_train_logs():
    """The PV-tuning training logs of the target variants (none when PV-tuning is off)."""
    if not PLAN.pv_enabled:
        return []
    pattern = rules.pvtune.output.train_log
    return [output_path(pattern, **variant) for variant in PLAN.targets()]


def all_targets(wildcards):
    """Every target variant's eval.json, the baselines, the report, and every layer artifact:
    Snakemake regenerates a deleted file only when it is requested, so listing the layers here
    makes a deleted layer rerun (with what follows it) on the next plain `snakemake`."""
    layers = []
    for variant in PLAN.targets():
        layers += layer_artifacts(SimpleNamespace(**variant))
    return target_evals() + baseline_evals() + [rules.report.output.table] + layers


def target_calibrations(wildcards):
    """The calibration folders (checkpoint outputs) of the targets' models: the report's job list
    (`job_benchmarks`) reads which layers they found."""
    return [calibration_dir(SimpleNamespace(model=m)) for m in PLAN.target_models()]


def job_benchmarks(wildcards):
    """The benchmark file of every job behind the report (each is an output of its job)."""
    jobs = PLAN.report_jobs(quantized_layers, num_blocks)
    return [output_path(getattr(rules, rule).benchmark, **wcs) for rule, wcs in jobs]
