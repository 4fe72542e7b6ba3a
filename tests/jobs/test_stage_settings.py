"""The one mapping from a rule's params to its stage's settings: every key the config schema allows in
a section reaches the stage field it names, with its value, and nothing is guessed."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from aqflow.jobs import stage_settings
from aqflow.jobs.stage_settings import Execution
from aqflow.stagekit.stage_cli import from_dict

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["properties"]
EXECUTION = Execution(warm_workers=False, warm_worker_idle_seconds=20, logits_budget_gib=3.5, cell_order=(),
                      save_state_every=7)


def example(spec: dict, key: str):
    """A value the schema allows for `key` that differs from the stages' defaults where it can."""
    if "enum" in spec:
        return spec["enum"][-1]
    kind = spec.get("type")
    kind = next(k for k in kind if k != "null") if isinstance(kind, list) else kind
    if kind == "array":
        item = spec.get("items", {})
        return [item["enum"][0]] if "enum" in item else ["x"]
    return {"boolean": False, "integer": 3, "number": 0.25, "string": "x"}[kind]


def section_example(section: str, leave_out=()) -> dict:
    properties = SCHEMA[section]["properties"]
    return {key: example(spec, key) for key, spec in properties.items() if key not in leave_out}


def test_every_pvtune_key_reaches_its_field_in_the_data_or_the_loop():
    from aqflow.stages.pvtune import PvtuneSettings

    section = section_example("pvtune", leave_out=("enabled", "save_state_every")) | {"update_codes": True}
    built = from_dict(PvtuneSettings, stage_settings.pvtune(section, EXECUTION))
    for key, value in section.items():
        where = built if key in stage_settings.PVTUNE_DATA_KEYS else built.training
        assert getattr(where, key) == value, key
    assert built.save_state_every == 7 and not built.quiet  # its progress goes to the job log
    # the data keys are the stage's own fields, none of them a loop setting: nothing is ambiguous
    loop = {spec.name for spec in dataclasses.fields(type(built.training))}
    assert set(stage_settings.PVTUNE_DATA_KEYS) <= {spec.name for spec in dataclasses.fields(PvtuneSettings)} - loop


def test_every_evaluation_key_and_the_logits_budget_reach_the_evaluate_stage():
    from aqflow.stages.evaluate import EvaluateSettings

    section = section_example("evaluation")
    built = from_dict(EvaluateSettings, stage_settings.evaluate(section, "tiny/fp", {"model": "tiny"}, EXECUTION))
    for key, value in section.items():
        assert getattr(built, key) == (tuple(value) if isinstance(value, list) else value), key
    assert built.logits_budget_gib == 3.5 and built.label == "tiny/fp" and built.upstream == {"model": "tiny"}
    assert built.perplexity is None
    no_domains = stage_settings.evaluate(section, "x", {}, EXECUTION, with_perplexity=False)
    assert from_dict(EvaluateSettings, no_domains).perplexity == ()


def test_quantization_calibration_and_block_finetune_keys_reach_their_stages():
    from aqflow.jobs.plan import CALIBRATE_BLOCK_KEYS, CALIBRATE_KEYS
    from aqflow.stages.calibrate import CalibrateSettings
    from aqflow.stages.calibrate_block import CalibrateBlockSettings
    from aqflow.stages.finetune_block import FinetuneBlockSettings
    from aqflow.stages.quantize_layer import QuantizeLayerSettings

    quantization = section_example("quantization")
    built = from_dict(QuantizeLayerSettings, stage_settings.quantize_layer({**quantization, "init": "oaem"}))
    assert all(getattr(built.quantizer, key) == value for key, value in quantization.items())
    calibration = section_example("calibration", leave_out=("block_finetune",))
    for mode, devices in (("fp", 4), ("sequential", 1)):
        chosen = {key: calibration[key] for key in CALIBRATE_KEYS} | {"propagation": mode}
        built = from_dict(CalibrateSettings, stage_settings.calibrate(chosen, num_gpus=4))
        assert all(getattr(built, key) == value for key, value in chosen.items()) and built.num_devices == devices
    chosen = {key: calibration[key] for key in CALIBRATE_BLOCK_KEYS}
    assert from_dict(CalibrateBlockSettings, stage_settings.calibrate_block(chosen, 2)).batch_size == chosen["batch_size"]
    tuning = {key: example(spec, key) for key, spec in SCHEMA["calibration"]["properties"]["block_finetune"]
              ["properties"].items() if key != "enabled"}
    built = from_dict(FinetuneBlockSettings, stage_settings.finetune_block(tuning, 1))
    assert dataclasses.asdict(built.tuning) == tuning and built.block == 1


def test_a_user_corpus_entry_and_the_data_section_reach_fetch_data_under_its_names():
    from aqflow.stages.fetch_data import FetchDataSettings

    entry = {key: example(spec, key) for key, spec in SCHEMA["corpora"]["additionalProperties"]["properties"].items()}
    built = from_dict(FetchDataSettings, stage_settings.fetch_data("notes", entry, 0.25, 3))
    assert (built.corpus, built.calibration_fraction, built.seed) == ("notes", 0.25, 3)
    for key, field in stage_settings.USER_CORPUS_KEYS.items():
        assert getattr(built, field) == entry[key], key
    # what is no fetch-data setting: the file (an input path), its share and protocol (the rule's params)
    assert set(entry) - set(stage_settings.USER_CORPUS_KEYS) == {"path", "calibration_fraction", "protocol"}


def test_a_models_request_reaches_fetch_model_and_its_folder_is_an_input():
    from aqflow.stages.fetch_model import FetchModelSettings

    request = {"preset": "tiny", "dtype": "float32", "tiny_layers": 2, "tiny_hidden": 64, "group_size": 8}
    assert dataclasses.asdict(from_dict(FetchModelSettings, stage_settings.fetch_model(request))).items() >= request.items()
    assert stage_settings.fetch_model({"path": "/models/mine", "group_size": 8}) == {"group_size": 8}


def test_a_flat_loop_setting_is_refused_not_placed():
    from aqflow.stages.pvtune import PvtuneSettings

    with pytest.raises(TypeError, match="code_lr"):
        from_dict(PvtuneSettings, {"code_lr": 0.05})


def test_every_speed_key_and_the_jobs_threads_reach_the_speed_stage():
    from aqflow.stages.speed import SpeedSettings

    section = section_example("speed", leave_out=("enabled",)) | {"devices": ["cuda:1", "cpu"], "paths": ["plain"]}
    built = from_dict(SpeedSettings, stage_settings.speed(section, threads=6))
    for key, value in section.items():
        assert getattr(built, key) == (tuple(value) if isinstance(value, list) else value), key
    assert built.threads == 6
    # every stage setting but the job's threads is a config key
    assert {spec.name for spec in dataclasses.fields(SpeedSettings)} == set(section) | {"threads"}
