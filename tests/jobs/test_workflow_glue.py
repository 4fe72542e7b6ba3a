"""A setting's trip from config.yaml to its stage, without Snakemake: the params the plan gives a
rule, read by the glue from a job shaped like Snakemake's, build the stage's dataclasses with every
key the config schema allows in a section in the field it names; nothing is guessed."""

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from snakemake.iocontainers import InputFiles, Namedlist, Params, Wildcards

from aqflow.io.artifacts import write_json
from aqflow.jobs import workflow_glue
from aqflow.jobs.plan import WorkflowPlan
from aqflow.stagekit.stage_cli import from_dict, stage_classes
from tests.jobs.test_plan import GREEDY, tiny_config

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["properties"]


def example(spec: dict):
    """A value the schema allows that differs from the stages' defaults where it can."""
    if "enum" in spec:
        return spec["enum"][-1]
    kind = spec.get("type")
    kind = next(k for k in kind if k != "null") if isinstance(kind, list) else kind
    if kind == "array":
        item = spec.get("items", {})
        return [item["enum"][0]] if "enum" in item else ["x"]
    return {"boolean": False, "integer": 3, "number": 0.25, "string": "x"}[kind]


def section_example(properties: dict, leave_out=()) -> dict:
    return {key: example(spec) for key, spec in properties.items() if key not in leave_out}


def job(params=None, input=None, output=None, wildcards=None, gpu=0):
    """A rule script's `snakemake` object as far as the glue reads it."""
    return SimpleNamespace(params=Params(fromdict=params or {}), input=InputFiles(fromdict=input or {}),
                           output=Namedlist(fromdict=output or {}), wildcards=Wildcards(fromdict=wildcards or {}),
                           resources=Namedlist(fromdict={"gpu": gpu}), log=["job.log"])


def built(stage: str, call: workflow_glue.StageCall):
    """The stage's (settings, paths) dataclasses from a call, as the job's process builds them."""
    from aqflow.__main__ import STAGES
    import importlib

    settings_class, paths_class = stage_classes(importlib.import_module(STAGES[stage]).run)
    return from_dict(settings_class, call.settings), from_dict(paths_class, call.paths)


def test_every_pvtune_key_reaches_its_field_in_the_data_or_the_loop():
    section = section_example(SCHEMA["pvtune"]["properties"], leave_out=("enabled",)) | {"update_codes": True}
    plan = WorkflowPlan(tiny_config(pvtune=section, execution={"pvtune_memory_wait_seconds": 42}))
    pvtune_job = job(params={"settings": plan.pvtune_settings(), "execution": plan.execution},
                     input={"model": "m", "checkpoint": "c", "corpus": "c.parquet"},
                     output={"model": "pv/model", "train_log": "pv/log.parquet", "metrics": "pv/pvtune.json"}, gpu=2)
    call = workflow_glue.pvtune(pvtune_job)
    settings, paths = built("pvtune", call)
    for key, value in section.items():
        if key == "save_state_every":  # how the job runs: through `execution`, no compared param
            assert settings.save_state_every == value
        else:
            where = settings if key in workflow_glue.PVTUNE_DATA_KEYS else settings.training
            assert getattr(where, key) == value, key
    assert settings.memory_wait_seconds == 42  # how the job runs, from `execution`
    assert not settings.quiet and call.processes == 2  # its progress goes to the job log; torchrun over 2 GPUs
    assert paths.state_dir == Path("pv/state")
    # the data keys are the stage's own fields, none of them a loop setting: nothing is ambiguous
    loop = {spec.name for spec in dataclasses.fields(type(settings.training))}
    assert set(workflow_glue.PVTUNE_DATA_KEYS) <= {spec.name for spec in dataclasses.fields(type(settings))} - loop


def test_every_evaluation_key_the_logits_budget_and_the_kernels_reach_the_evaluate_stage(tmp_path):
    section = section_example(SCHEMA["evaluation"]["properties"])
    plan = WorkflowPlan(tiny_config(evaluation=section, execution={"logits_budget_gib": 3.5, "cpu_kernel": "aqlm",
                                                                    "gpu_kernel": "aqlm"}))
    params = {"evaluation": plan.evaluation_settings(), "domains": plan.domains(GREEDY), "settings": {},
              "calibration": {}, "label": plan.fp_label(GREEDY), "execution": plan.execution}
    corpora = [str(tmp_path / "wikitext2-standin.parquet"), str(tmp_path / "c4-standin.parquet")]
    for corpus in corpora:
        Path(corpus).touch()
    fp_job = job(params=params, input={"model": "m", "layer_metrics": [], "tuned_blocks": [], "corpora": corpora},
                 output={"eval": "fp/eval.json"}, wildcards={"model": "tiny"})
    settings, paths = built("evaluate", workflow_glue.evaluate(fp_job))
    for key, value in section.items():
        assert getattr(settings, key) == (tuple(value) if isinstance(value, list) else value), key
    assert settings.logits_budget_gib == 3.5 and settings.label == "tiny/fp" and settings.perplexity is None
    assert settings.cpu_kernel == "aqlm" and settings.gpu_kernel == "aqlm"
    assert paths.domain == (("wikitext2-standin", "joined", corpora[0]), ("c4-standin", "sampled", corpora[1]))
    assert settings.upstream == {"model": "tiny", "bpp": None, "quantizer": {}, "calibration": {},
                                 "evaluation": plan.evaluation_settings(), "layers": [], "block_finetune": [],
                                 "quantization_seconds": None}
    no_domains = job(params={**params, "domains": []}, input={"model": "m", "layer_metrics": [], "tuned_blocks": []},
                     output={"eval": "fp/eval.json"}, wildcards={"model": "tiny"})
    assert built("evaluate", workflow_glue.evaluate(no_domains))[0].perplexity == ()


def test_the_execution_fields_marked_for_a_stage_are_exactly_those_it_declares():
    """`execution` settings reach the evaluate stage by their own names, marked in the Execution
    dataclass: a field both declare but left unmarked (or marked but unknown to the stage) fails."""
    from aqflow.jobs.plan import Execution
    from aqflow.stages.evaluate import EvaluateSettings

    both = {spec.name for spec in dataclasses.fields(Execution)} & {spec.name for spec in dataclasses.fields(EvaluateSettings)}
    execution = WorkflowPlan(tiny_config()).execution
    assert set(execution.stage_options("evaluate")) == both == {"logits_budget_gib", "cpu_kernel", "gpu_kernel"}
    from aqflow.stages.pvtune import PvtuneSettings

    both = {spec.name for spec in dataclasses.fields(Execution)} & {spec.name for spec in dataclasses.fields(PvtuneSettings)}
    assert set(execution.stage_options("pvtune")) == both == {"save_state_every", "memory_wait_seconds"}


def test_a_pv_tuned_evaluation_embeds_its_layers_and_its_training_record(tmp_path):
    """The upstream record of eval.json: the rule's settings, each layer's metrics (the quantization
    time their sum), and the PV-tuning record whole; the pre-PV evaluation is a path."""
    plan = WorkflowPlan(tiny_config())
    for layer, seconds in (("q", 1.5), ("k", 2.0)):
        write_json(tmp_path / f"{layer}.json", {"layer": layer, "total_seconds": seconds, "epochs": [{}, {}], "rho": 3})
    write_json(tmp_path / "pvtune.json", {"best_step": 4})
    params = {"evaluation": plan.evaluation_settings(), "domains": [], "settings": plan.quantizer_settings(GREEDY),
              "calibration": plan.calibration_record(GREEDY), "label": plan.pvtuned_label(GREEDY),
              "execution": plan.execution}
    pv_job = job(params=params, input={"model": "pv/model", "pvtune": str(tmp_path / "pvtune.json"),
                                       "pre_pv": "eval_pre_pv.json", "layer_metrics": [str(tmp_path / "q.json"),
                                                                                        str(tmp_path / "k.json")],
                                       "tuned_blocks": []},
                 output={"eval": "eval.json"}, wildcards=vars(GREEDY))
    settings, paths = built("evaluate", workflow_glue.evaluate(pv_job))
    upstream = settings.upstream
    assert [layer["layer"] for layer in upstream["layers"]] == ["q", "k"] and upstream["layers"][0]["epochs"] == 2
    assert upstream["quantization_seconds"] == 3.5 and upstream["pvtune"] == {"best_step": 4}
    assert upstream["bpp"] == 2 and upstream["quantizer"] == plan.quantizer_settings(GREEDY)
    assert paths.pre_pv == Path("eval_pre_pv.json") and settings.label == "tiny/2bpp/greedy/b2e2+pv"


def test_every_quantization_key_and_the_path_reach_the_layer_job():
    section = section_example(SCHEMA["quantization"]["properties"])
    for warm in (False, True):
        plan = WorkflowPlan(tiny_config(quantization=section, execution={"warm_workers": warm,
                                                                         "warm_worker_idle_seconds": 7}))
        wildcards = {**vars(GREEDY), "variant": "b3e5", "layer": "model.layers.0.mlp.up_proj"}
        layer_job = job(params={"settings": plan.quantizer_settings(SimpleNamespace(**wildcards)),
                                "execution": plan.execution},
                        input={"model": "m", "calibration": "c"}, output={"layer": "l.safetensors", "metrics": "l.json"},
                        wildcards=wildcards)
        call = workflow_glue.quantize_layer(layer_job)
        settings, paths = built("quantize-layer", call)
        assert all(getattr(settings.quantizer, key) == value for key, value in section.items() if key != "max_epochs")
        assert (settings.quantizer.beam_size, settings.quantizer.max_epochs, settings.quantizer.init) == (3, 5, "greedy")
        assert paths.layer == "model.layers.0.mlp.up_proj"
        assert call.warm_worker_idle_seconds == (7 if warm else None)


def test_calibration_and_block_finetune_keys_reach_their_stages():
    calibration = section_example(SCHEMA["calibration"]["properties"], leave_out=("block_finetune", "propagation"))
    tuning = section_example(SCHEMA["calibration"]["properties"]["block_finetune"]["properties"], leave_out=("enabled",))
    for mode, devices in (("fp", 4), ("sequential", 1)):
        chosen = {**calibration, "propagation": mode}
        if mode == "sequential":
            chosen["block_finetune"] = {**tuning, "enabled": True}
        plan = WorkflowPlan(tiny_config(calibration=chosen))
        call = workflow_glue.calibrate(job(params={"settings": plan.calibrate_settings()},
                                           input={"model": "m", "corpus": "c.parquet"}, output={"dir": "calib"}, gpu=4))
        settings, _ = built("calibrate", call)
        assert all(getattr(settings, key) == value for key, value in chosen.items()
                   if key not in ("keep_block_inputs", "block_finetune")), mode  # keep_block_inputs: the rule's temp()
        assert settings.num_devices == devices
    block_job = job(params={"settings": plan.calibrate_block_settings(), "previous_layers_dir": "layers",
                            "previous_block_tensors": ""},
                    input={"model": "m", "calibration": "calib", "previous_inputs": "block1.inputs.safetensors"},
                    output={"calibration": "block2", "inputs": "block2.inputs.safetensors"}, wildcards={"block": "2"})
    settings, paths = built("calibrate-block", workflow_glue.calibrate_block(block_job))
    assert (settings.batch_size, settings.block) == (calibration["batch_size"], 2)
    assert paths.previous_inputs == Path("block1.inputs.safetensors") and paths.previous_block_tensors is None
    tune_job = job(params={"settings": plan.block_finetune, "layers_dir": "layers"},
                   input={"model": "m", "calibration": "calib", "inputs": []}, output={"dir": "tuned/block0"},
                   wildcards={"block": "0"})
    settings, paths = built("finetune-block", workflow_glue.finetune_block(tune_job))
    assert dataclasses.asdict(settings.tuning) == tuning and settings.block == 0 and paths.inputs is None


def test_a_user_corpus_entry_and_the_data_section_reach_fetch_data_under_its_names():
    entry = section_example(SCHEMA["corpora"]["additionalProperties"]["properties"])
    plan = WorkflowPlan(tiny_config(corpora={"notes": entry}, data={"calibration_fraction": 0.25, "split_seed": 3}))
    wildcards = SimpleNamespace(corpus="notes")
    data_job = job(params={"calibration_fraction": plan.calibration_fraction(wildcards), "seed": 3,
                           "user": plan.user_corpus(wildcards)},
                   output={"corpus": "notes.parquet", "split": "notes.split.json"}, wildcards={"corpus": "notes"})
    settings, paths = built("fetch-data", workflow_glue.fetch_data(data_job))
    assert (settings.corpus, settings.calibration_fraction, settings.seed) == ("notes", 0.25, 3)
    for key, field in workflow_glue.USER_CORPUS_KEYS.items():
        assert getattr(settings, field) == entry[key], key
    assert paths.file == Path("x")
    # what is no fetch-data setting: the file (an input path), its share and protocol (the rule's params)
    assert set(entry) - set(workflow_glue.USER_CORPUS_KEYS) == {"path", "calibration_fraction", "protocol"}


def test_a_models_request_reaches_fetch_model_and_its_folder_is_an_input():
    plan = WorkflowPlan(tiny_config())
    settings, _ = built("fetch-model", workflow_glue.fetch_model(
        job(params={"request": plan.fetch_model_settings(GREEDY)}, output={"dir": "models/tiny"})))
    assert (settings.preset, settings.dtype, settings.tiny_layers, settings.tiny_hidden, settings.group_size) == (
        "tiny", "float32", 2, 64, 8)
    local = workflow_glue.fetch_model(job(params={"request": {"path": "/models/mine", "group_size": 8}},
                                          output={"dir": "models/mine"}))
    assert local.settings == {"group_size": 8} and local.paths["path"] == "/models/mine"


def test_every_speed_key_and_the_jobs_threads_reach_the_speed_stage():
    section = section_example(SCHEMA["speed"]["properties"], leave_out=("enabled",)) | {"devices": ["cuda:1", "cpu"],
                                                                                         "paths": ["plain"]}
    plan = WorkflowPlan(tiny_config(speed={"enabled": True, **section}))
    speed_job = job(params={"settings": plan.speed_settings()}, input={"model": "model"}, output={"json": "speed.json"})
    speed_job.threads = 6
    settings, paths = built("speed", workflow_glue.speed(speed_job))
    for key, value in section.items():
        assert getattr(settings, key) == (tuple(value) if isinstance(value, list) else value), key
    assert settings.threads == 6 and paths.output == Path("speed.json")
    # every stage setting but the job's threads is a config key
    assert {spec.name for spec in dataclasses.fields(settings)} == set(section) | {"threads"}


def test_the_other_stages_calls_build_their_dataclasses():
    plan = WorkflowPlan(tiny_config())
    stitch = job(params={"layers_dirs": ["layers"], "replace_tensors": [],
                         **{key: plan.quantizer_setting(key)(GREEDY) for key in ("num_codebooks", "nbits", "group_size")}},
                 input={"model": "m"}, output={"dir": "model"})
    assert built("stitch", workflow_glue.stitch(stitch))[0].nbits == plan.bitrate(2)["nbits"] == 6
    distances = job(input={"model": "m", "calibration": "c.parquet", "corpora": "w.parquet"}, output={"json": "d.json"})
    assert built("domain-distances", workflow_glue.domain_distances(distances))[1].corpora == (Path("w.parquet"),)
    tables = job(params={"domains": [], "models": ["tiny"]}, input={"grid": "grid.json", "distances": "domains.json"},
                 output={"readme": "results/paper/README.md"})
    assert built("paper-tables", workflow_glue.paper_tables(tables))[1].domain_distances == ("tiny=domains.json",)
    outputs = {name: f"{name}.out" for name in ("table", "parquet", "pareto", "layers", "pv_curves", "stage_times")}
    report = job(params={"benchmarks": []}, input={"evals": ["eval.json"], "pv_logs": [], "speeds": []}, output=outputs)
    assert built("report", workflow_glue.report(report))[1].evals == (Path("eval.json"),)
    with_speed = job(params={"benchmarks": []}, input={"evals": ["eval.json"], "pv_logs": [], "speeds": ["speed.json"]},
                     output={**outputs, "speed": "speed.png"})
    _, paths = built("report", workflow_glue.report(with_speed))
    assert paths.speeds == (Path("speed.json"),) and paths.speed_plot == Path("speed.png")


def test_every_rule_script_is_one_line_naming_a_stage_the_glue_calls():
    from aqflow.__main__ import STAGES

    assert set(workflow_glue.JOB_CALLS) <= set(STAGES)
    for script in sorted((REPO / "workflow" / "scripts").glob("*.py")):
        if script.stem == "paper_grid":  # writes grid.json itself: no stage
            continue
        stage = re.fullmatch(r'from aqflow.jobs.workflow_glue import run_job\n\nif __name__ == "__main__":.*\n'
                             r'    run_job\(snakemake, "([\w-]+)"\)\n', script.read_text()).group(1)
        assert workflow_glue.JOB_CALLS[stage].__name__ == script.stem == stage.replace("-", "_"), script


def test_a_flat_loop_setting_is_refused_not_placed():
    from aqflow.stages.pvtune import PvtuneSettings

    with pytest.raises(TypeError, match="code_lr"):
        from_dict(PvtuneSettings, {"code_lr": 0.05})
