"""The plan of a config, without Snakemake: the params finished runs recorded, the checks that refuse
impossible targets by name (a geometry against the layer widths included), the variant grammar,
grids and priorities."""

import copy
import itertools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from aqflow.jobs.plan import VARIANT_REGEX, WorkflowPlan, geometry_name, parse_variant, variant_name

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
GREEDY = SimpleNamespace(model="tiny", bpp="2", init="greedy", variant="b2e2")


def with_defaults(config: dict, schema: dict) -> dict:
    """The schema's defaults filled in, as Snakemake's validate does before the plan is made."""
    for key, spec in schema.get("properties", {}).items():
        if "default" in spec and key not in config:
            config[key] = copy.deepcopy(spec["default"])
        if isinstance(config.get(key), dict) and "properties" in spec:
            with_defaults(config[key], spec)
    return config


def tiny_config(**sections) -> dict:
    config = yaml.safe_load((REPO / "tests" / "workflow" / "config.tiny.yaml").read_text())
    for name, changes in sections.items():
        config[name] = {**config.get(name, {}), **changes}
    return with_defaults(config, SCHEMA)


def test_the_params_are_the_values_runs_made_before_the_plan_recorded():
    """Snakemake reruns a job whose params' repr changed: these are the reprs a finished tiny run
    recorded with the Snakefile's own code, before that code became this module; since then only
    the V-step's unit (code_lr_scale) joined PV-tuning's, when its default became weight_rms."""
    plan = WorkflowPlan(tiny_config())
    assert repr(plan.quantizer_settings(GREEDY)) == (
        "{'beam_size': 2, 'group_size': 8, 'init': 'greedy', 'kmeans_max_iter': 50, 'lr': 0.0001, 'max_epochs': 2, "
        "'nbits': 6, 'num_codebooks': 2, 'oaem_damping': 0.01, 'oaem_lr': 0.0001, 'oaem_rounds': 2, 'oaem_steps': 20, "
        "'relative_tolerance': 0.0, 'seed': 42, 'steps_per_epoch': 20}")
    assert repr(plan.pvtune_settings()) == (
        "{'batch_size': 4, 'code_lr': 0.001, 'code_lr_scale': 'weight_rms', 'epochs': 1, 'eval_every_steps': 1, 'heldout_fraction': 0.1, "
        "'heldout_samples': 4, 'kl_chunk_tokens': 64, 'lr': 0.0001, 'max_code_change_fraction': 0.05, "
        "'micro_batch_size': 2, 'num_samples': 8, 'window_tokens': 64}")
    assert repr(plan.calibration_record(GREEDY)) == (
        "{'batch_size': 4, 'corpus': 'c4-standin', 'num_windows': 8, 'propagation': 'fp', 'seed': 0, 'window_tokens': 64}")
    assert repr(plan.calibrate_settings()) == (
        "{'batch_size': 4, 'num_windows': 8, 'propagation': 'fp', 'seed': 0, 'window_tokens': 64}")
    assert repr(plan.evaluation_settings()) == (
        "{'batch_size': 4, 'c4_windows': 8, 'context': 64, 'max_windows': 8, 'task_limit': 4, 'tasks': ['arc_easy', 'arc_challenge', 'hellaswag', 'piqa', 'winogrande', "
        "'lambada_openai']}")
    assert plan.domains(GREEDY) == [["wikitext2-standin", "joined"], ["c4-standin", "sampled"]]
    assert repr(plan.fetch_model_settings(GREEDY)) == (
        "{'preset': 'tiny', 'dtype': 'float32', 'tiny_layers': 2, 'tiny_hidden': 64, 'group_size': 8}")
    assert plan.pvtuned_label(GREEDY) == "tiny/2bpp/greedy/b2e2+pv" and plan.fp_label(GREEDY) == "tiny/fp"
    assert plan.calibration_id("tiny") == "c4-standin-n8-t64-s0-fp"
    assert [plan.quantizer_setting(key)(GREEDY) for key in ("num_codebooks", "nbits", "group_size")] == [2, 6, 8]


def test_the_v_step_unit_is_a_param_and_the_state_interval_is_not():
    # either unit is passed as written: the stage's default (weight_rms) never stands in for absolute
    for unit in ("absolute", "weight_rms"):
        assert WorkflowPlan(tiny_config(pvtune={"code_lr_scale": unit})).pvtune_settings()["code_lr_scale"] == unit
    # how often PV-tuning saves its state is how the job runs: no param, the job's execution
    config = tiny_config(pvtune={"save_state_every": 7}, execution={"logits_budget_gib": 2})
    assert "save_state_every" not in WorkflowPlan(config).pvtune_settings()
    execution = WorkflowPlan(config).execution
    assert execution.save_state_every == 7 and execution.logits_budget_gib == 2


@pytest.mark.parametrize("wildcards, named", [
    ({"model": "huge"}, "wildcard model='huge' is not one of config models: allowed ['tiny']"),
    ({"model": "tiny", "bpp": "3"}, "wildcard bpp='3' is not one of config bitrates: allowed ['2']"),
    ({"model": "tiny", "bpp": "2", "init": "kmeans"}, "wildcard init='kmeans' is not one of the known inits"),
    ({"model": "tiny", "bpp": "2", "init": "oaem", "variant": "b0"}, "wildcard variant='b0': beam and epochs"),
    ({"model": "tiny", "bpp": "2", "init": "oaem", "variant": "b2e0"}, "wildcard variant='b2e0'"),
    ({"model": "tiny", "bpp": "2", "init": "oaem", "variant": "g8m3k256-b2"}, "variant 'g8m3k256-b2' stores 3 code bits"),
])
def test_an_impossible_target_is_refused_naming_what_is_wrong(wildcards, named):
    plan = WorkflowPlan(tiny_config())
    with pytest.raises(ValueError, match="^" + named.replace("[", r"\[").replace("(", r"\(")):
        if "variant" in wildcards:
            plan.variant_folder(SimpleNamespace(**wildcards))
        else:
            plan.check_model(SimpleNamespace(**wildcards))


@pytest.mark.parametrize("sections, named", [
    ({"models": {"report": {"preset": "tiny"}}}, "are folders of results/"),
    ({"calibration": {"block_finetune": {"enabled": True}}}, "needs calibration.propagation: sequential"),
    ({"text": {"offline": {"calibration": "wikitext2"}}}, "text.offline.calibration: corpus 'wikitext2' is evaluation"),
    ({"corpora": {"c4": {"path": "x.txt"}}}, "built-in corpus names"),
])
def test_an_impossible_config_is_refused_before_any_job(sections, named):
    config = tiny_config(**{key: value for key, value in sections.items() if key != "models"})
    config["models"].update(sections.get("models", {}))
    with pytest.raises(ValueError, match=named):
        WorkflowPlan(config)


def test_a_grid_multiplies_out_and_a_cell_equal_to_a_target_is_its_run():
    grid = {"models": ["tiny"], "cells": [
        {"bpp": 2, "inits": ["greedy", "oaem"], "beams": [2], "epochs": [2], "seeds": [42, 43]},
        {"bpp": 2, "inits": ["greedy"], "beams": [2], "geometries": ["g8m2k64", "g4m1k64"]},
        {"bpp": 2, "inits": ["greedy"], "beams": [2], "seeds": [42]},  # the first entry's cell again
    ]}
    plan = WorkflowPlan(tiny_config(experiments={"paper": grid}))
    evals = plan.experiment_evals("paper")
    assert evals == ["results/tiny/2bpp/greedy/b2/eval.json", "results/tiny/2bpp/greedy/b2s43/eval.json",
                     "results/tiny/2bpp/oaem/b2/eval.json", "results/tiny/2bpp/oaem/b2s43/eval.json",
                     "results/tiny/2bpp/greedy/g4m1k64-b2/eval.json"]
    # the configured epoch budget and seed and the bit rate's geometry stay out of the path, as in targets
    assert plan.final_eval(plan.targets()[0]) == "results/tiny/2bpp/greedy/b2e2/eval.json"
    assert plan.experiment_models("paper") == ["tiny"] and plan.experiment_domains("paper") == []
    with pytest.raises(ValueError, match="no experiment grid 'other'"):
        plan.experiment_cells("other")


def test_listed_cells_go_first_in_order_and_their_models_shared_jobs_with_them():
    order = ["results/tiny/2bpp/oaem/b2e2/eval.json", "results/tiny/2bpp/greedy/b2e2/eval.json"]
    plan = WorkflowPlan(tiny_config(execution={"cell_order": order}))
    assert plan.cell_priority(SimpleNamespace(model="tiny", bpp="2", init="oaem", variant="b2e2")) == 2
    assert plan.cell_priority(GREEDY) == 1
    assert plan.cell_priority(SimpleNamespace(model="tiny", bpp="2", init="oaem", variant="b4")) == 0
    assert plan.model_priority(SimpleNamespace(model="tiny")) == 2
    assert WorkflowPlan(tiny_config()).model_priority(SimpleNamespace(model="tiny")) == 0


def test_the_report_reads_every_job_of_the_targets_once_in_a_fixed_order():
    plan = WorkflowPlan(tiny_config(calibration={"propagation": "sequential", "block_finetune": {"enabled": True}}))
    jobs = plan.report_jobs(lambda wildcards: ["model.layers.0.mlp", "model.layers.1.mlp"], lambda wildcards: 2)
    rules = [rule for rule, _ in jobs]
    assert rules[:5] == ["fetch_model", "calibrate", "evaluate_fp", "fetch_data", "fetch_data"]
    per_variant = ["quantize_layer", "quantize_layer", "calibrate_block", "finetune_block", "finetune_block",
                   "stitch", "evaluate_quantized", "pvtune", "evaluate_pvtuned"]
    assert rules[5:] == per_variant * 2
    assert jobs[1][1] == {"model": "tiny", "calib": "c4-standin-n8-t64-s0-sequential"}
    assert jobs[7] == ("calibrate_block", {"model": "tiny", "bpp": 2, "init": "greedy", "variant": "b2e2", "block": 1})


def test_resources_are_the_rules_over_the_default():
    plan = WorkflowPlan(tiny_config(resources={"evaluate": {"cpus": 3, "gpu": 1}}))
    assert plan.threads("evaluate") == 3 and plan.threads("stitch") == 1
    assert plan.resources("evaluate") == {"mem_mb": 2000, "runtime": 10, "gpu": 1}


G6 = SimpleNamespace(model="tiny", bpp="2", init="greedy", variant="g6m2k64-b2")


def test_a_geometry_that_does_not_divide_a_layer_is_refused_naming_model_geometry_and_layer(tmp_path):
    """g6m2k64 stores 2 bits per weight like the tiny 2bpp folder, but 6 does not divide the tiny
    model's 64 inputs: refused before any job, from the preset's own sizes (nothing fetched yet)."""
    plan = WorkflowPlan(tiny_config(), model_folder=lambda model: str(tmp_path / model))
    with pytest.raises(ValueError, match=r"^model 'tiny', variant 'g6m2k64-b2': geometry g6m2k64 \(group size 6\) "
                                         r"does not divide the 64 inputs of model.layers.0.self_attn.q_proj "
                                         r"\(widths from the tiny preset\)"):
        plan.variant_folder(G6)
    assert plan.variant_folder(GREEDY) == "results/tiny/2bpp/greedy/b2e2"
    # the same refused for a grid cell of the config, when the Snakefile is read
    grid = {"grid": {"models": ["tiny"], "cells": [{"bpp": 2, "inits": ["greedy"], "beams": [2],
                                                     "geometries": ["g8m2k64", "g6m2k64"]}]}}
    with pytest.raises(ValueError, match="variant 'g6m2k64-b2': geometry g6m2k64"):
        WorkflowPlan(tiny_config(experiments=grid), model_folder=lambda model: str(tmp_path / model)).check_geometries()
    WorkflowPlan(tiny_config(), model_folder=lambda model: str(tmp_path / model)).check_geometries()


def test_a_fetched_folder_gives_every_layer_width_from_its_safetensors_header(tmp_path):
    """Once fetched, the widths are the weights' own (here a layer the Llama layout would not name)."""
    header = {"model.layers.0.self_attn.q_proj.weight": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 0]},
              "model.layers.1.mixer.in_proj.weight": {"dtype": "F32", "shape": [64, 80], "data_offsets": [0, 0]},
              "model.layers.0.input_layernorm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 0]},
              "model.embed_tokens.weight": {"dtype": "F32", "shape": [512, 66], "data_offsets": [0, 0]}}
    raw = json.dumps(header).encode()
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    plan = WorkflowPlan(tiny_config(quantization={"group_size": 32}), model_folder=lambda model: str(tmp_path / model))
    with pytest.raises(ValueError, match=r"geometry g32m2k64 \(group size 32\) does not divide the 80 inputs of "
                                         rf"model.layers.1.mixer.in_proj \(widths from {tmp_path / 'tiny'}'s weights\)"):
        plan.variant_folder(SimpleNamespace(model="tiny", bpp="2", init="greedy", variant="b2"))


def test_speed_settings_are_the_section_less_its_switch_and_its_jobs_join_the_report():
    layers, blocks = (lambda wildcards: ["model.layers.0.mlp.up_proj"]), (lambda wildcards: 2)
    off = WorkflowPlan(tiny_config())
    assert not off.speed_enabled and not any(rule.startswith("speed") for rule, _ in off.report_jobs(layers, blocks))
    plan = WorkflowPlan(tiny_config(speed={"enabled": True, "new_tokens": 64}))
    assert plan.speed_enabled
    # the schema's defaults filled in (those it has: the stage's own), the switch left out
    assert plan.speed_settings() == {"dtype": "auto", "new_tokens": 64, "prefill_tokens": 1024,
                                     "prompt_tokens": 32, "seed": 0, "warmup_tokens": 8}
    assert list(plan.speed_settings()) == sorted(plan.speed_settings())  # params compared as written
    jobs = plan.report_jobs(layers, blocks)
    assert ("speed_fp", {"model": "tiny"}) in jobs
    assert [wildcards for rule, wildcards in jobs if rule == "speed"] == plan.targets()


# --- the variant grammar: one regex, a parser and its inverse -----------------------------------------

def test_every_name_parses_back_to_the_settings_it_was_made_from():
    for beam, epochs, seed, geometry in itertools.product((1, 8, 16), (None, 5), (None, 43), (None, "g6m2k64")):
        name = variant_name(beam, epochs, seed, geometry, default_seed=42, default_geometry="g8m2k256")
        assert re.fullmatch(VARIANT_REGEX, name), name
        parsed = parse_variant(name)
        assert parsed["beam_size"] == beam and parsed.get("max_epochs") == epochs and parsed.get("seed") == seed
        if geometry:
            assert geometry_name(parsed["group_size"], parsed["num_codebooks"], parsed["nbits"]) == geometry
        else:
            assert "group_size" not in parsed


def test_the_defaults_stay_out_of_the_path():
    """A grid cell with the configured seed and the bit rate's own geometry is the default target's run."""
    assert variant_name(8, None, 42, "g8m2k256", default_seed=42, default_geometry="g8m2k256") == "b8"
    assert variant_name(8, 5, 43, "g4m1k256", default_seed=42, default_geometry="g8m2k256") == "g4m1k256-b8e5s43"


@pytest.mark.parametrize("bad", ["8", "b", "b8x", "e5b8", "g6m2-b8", "b8s", "B8", "b8e5s43/"])
def test_what_the_regex_refuses_the_parser_refuses_by_name(bad):
    assert re.fullmatch(VARIANT_REGEX, bad) is None
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_variant(bad)


def test_codewords_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="k63 codewords must be a power of two"):
        parse_variant("g6m2k63-b8")
    assert parse_variant("g6m2k64-b8")["nbits"] == 6
