"""Every stage's typed entry point and the command line built from it (aqflow.stagekit.stage_cli)."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import aqflow
from aqflow.stagekit import stage_cli
from aqflow.__main__ import STAGES
from aqflow.stagekit.stage_errors import StageInputError

REPO = Path(__file__).resolve().parents[2]


def stage_modules():
    return {stage: importlib.import_module(module) for stage, module in STAGES.items()}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_runs_from_two_frozen_dataclasses(stage):
    module = importlib.import_module(STAGES[stage])
    settings_class, paths_class = stage_cli.stage_classes(module.run)
    for cls in (settings_class, paths_class):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    assert module.STAGE == stage
    assert all(issubclass(error, BaseException) for error in module.INPUT_ERRORS) and callable(module.summary)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_help_goes_to_stdout_with_defaults_and_choices(stage, capsys):
    module = importlib.import_module(STAGES[stage])
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: aqflow {stage}") and err == ""
    settings_class, _ = stage_cli.stage_classes(module.run)
    if any(spec.default is not dataclasses.MISSING for spec in dataclasses.fields(settings_class)):
        assert "(default: " in out


def test_the_top_level_help_gives_every_stage_a_one_line_description(capsys):
    """`python -m aqflow --help`: one line per stage, its description the first line of the stage
    module's docstring (without the command it names); read from the source, so no stage (and no
    torch) is imported for it."""
    import subprocess
    import sys

    from aqflow.__main__ import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    loaded = subprocess.run([sys.executable, "-c", "import sys; from aqflow.__main__ import main; main(['--help']); "
                             "print(sorted(m for m in sys.modules if m.startswith(('torch', 'aqflow.stages.'))))"],
                            capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    assert loaded == "[]"
    lines = out.split("stages:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in lines] == sorted(STAGES)
    for line in lines:
        name, description = line.split(maxsplit=1)
        doc = importlib.import_module(STAGES[name]).__doc__.strip().splitlines()[0]
        assert len(description) > 10 and doc.endswith(description) and "python -m" not in description


def test_quantize_layer_settings_survive_the_command_line_both_ways(tmp_path):
    """to_argv writes what parse reads back: switches as --x/--no-x, nested settings flat."""
    from aqflow.quant.quantize import QuantizerSettings
    from aqflow.stages import quantize_layer

    settings = quantize_layer.QuantizeLayerSettings(
        quantizer=QuantizerSettings(beam_size=3, group_size=4, init="greedy", shuffle_order=False, lr=3e-5),
        device="cpu", quiet=True)
    paths = quantize_layer.QuantizeLayerPaths(output=tmp_path / "l.safetensors", metrics=tmp_path / "l.json",
                                              model_dir=tmp_path / "m", calibration_dir=tmp_path / "c",
                                              layer="model.layers.0.mlp.up_proj")
    argv = stage_cli.to_argv(settings, paths)
    assert "--no-shuffle-order" in argv and "--beam-size" in argv
    parsed = stage_cli.parse(quantize_layer.build_parser(), (type(settings), type(paths)), argv)
    assert parsed == [settings, paths]


def test_evaluate_domains_and_an_empty_task_list_survive_the_command_line(tmp_path):
    from aqflow.stages import evaluate

    settings = evaluate.EvaluateSettings(tasks=(), perplexity=(), context=64, device="cpu")
    paths = evaluate.EvaluatePaths(model_dir=tmp_path, output=tmp_path / "eval.json",
                                   domain=(("notes", "joined", str(tmp_path / "notes.parquet")),
                                           ("c4", "sampled", str(tmp_path / "c4.parquet"))))
    argv = stage_cli.to_argv(settings, paths)
    assert stage_cli.parse(evaluate.build_parser(), (type(settings), type(paths)), argv) == [settings, paths]


def test_a_rules_plain_values_build_the_same_dataclasses(tmp_path):
    """What a rule script hands over (config values, str paths, a nested dataclass as a mapping) is
    what a person types: the same dataclasses either way. A key is never searched for in a nested
    dataclass: a loop setting given flat is an unknown key."""
    from aqflow.stages import pvtune

    from_rule = stage_cli.from_dict(pvtune.PvtuneSettings, {"training": {"lr": 1e-3, "update_codes": False},
                                                            "num_samples": 4, "device": "cpu"})
    typed = pvtune.PvtuneSettings(num_samples=4, device="cpu",
                                  training=dataclasses.replace(pvtune.PVSettings(), lr=1e-3, update_codes=False))
    assert from_rule == typed
    for wrong in ({"no_such_key": 1}, {"lr": 1e-3}):
        with pytest.raises(TypeError, match=next(iter(wrong))):
            stage_cli.from_dict(pvtune.PvtuneSettings, wrong)


def test_schema_defaults_are_the_stages_defaults():
    """A default written in the config schema (which Snakemake fills in) equals the stage setting it
    feeds, so the value exists once."""
    from aqflow.quant.quantize import QuantizerSettings
    from aqflow.stages.calibrate import CalibrateSettings
    from aqflow.stages.fetch_data import FetchDataSettings
    from aqflow.stages.pvtune import PvtuneSettings
    from aqflow.stages.speed import SpeedSettings

    def default_of(cls, name):
        for spec in dataclasses.fields(cls):
            if spec.name == name:
                return stage_cli._default(spec)
            kind = stage_cli._field_types(cls)[spec.name]
            if dataclasses.is_dataclass(kind):
                try:
                    return default_of(kind, name)
                except KeyError:
                    continue
        raise KeyError(f"{cls.__name__} has no setting {name}")

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["properties"]
    feeds = {"quantization": QuantizerSettings, "calibration": CalibrateSettings, "pvtune": PvtuneSettings,
             "data": FetchDataSettings, "speed": SpeedSettings}
    renamed = {("data", "split_seed"): "seed"}
    checked = 0
    for section, cls in feeds.items():
        for key, spec in schema[section]["properties"].items():
            if isinstance(spec, dict) and "default" in spec and (section, key) != ("speed", "enabled"):
                assert spec["default"] == default_of(cls, renamed.get((section, key), key)), (section, key)
                checked += 1
    assert checked >= 8
    assert schema["quantization"]["properties"]["group_size"]["default"] == QuantizerSettings.group_size


def test_an_input_error_is_one_line_and_a_bug_keeps_its_traceback(capsys):
    def refuses(settings, paths):
        raise StageInputError("--thing: not a thing")

    def breaks(settings, paths):
        raise KeyError("a bug")

    assert stage_cli.execute("demo", refuses, None, None, (StageInputError,), str) == 2
    assert capsys.readouterr().err.strip() == "aqflow demo: error: --thing: not a thing"
    with pytest.raises(KeyError, match="a bug"):
        stage_cli.execute("demo", breaks, None, None, (StageInputError,), str)


def test_version_and_the_stage_list():
    version = subprocess.run([sys.executable, "-m", "aqflow", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"aqflow {aqflow.__version__}"
    unknown = subprocess.run([sys.executable, "-m", "aqflow", "no-such-stage"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown stage 'no-such-stage'" in unknown.stderr and unknown.stdout == ""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "aqflow.__version__"' in pyproject


_EXIT_PROBE = """
import atexit, runpy, sys

class Teardown:
    def __del__(self):
        sys.stdout.write("torn down\\n")

KEPT = Teardown()  # a module global: freed by the interpreter's teardown, if that runs
atexit.register(lambda: print("atexit ran"))
sys.argv = ["aqflow", *sys.argv[1:]]
runpy.run_module("aqflow", run_name="__main__")
"""


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["no-such-stage"], 2)])
def test_python_m_aqflow_exits_with_the_stages_code_after_atexit_without_teardown(argv, code):
    finished = subprocess.run([sys.executable, "-c", _EXIT_PROBE, *argv], capture_output=True, text=True)
    assert finished.returncode == code
    assert "atexit ran" in finished.stdout  # callbacks run, the piped stdout reaches the reader
    assert "torn down" not in finished.stdout  # the module teardown (about a second with torch) is skipped
    assert (f"aqflow {aqflow.__version__}" in finished.stdout) == (code == 0)
    ordinary = subprocess.run([sys.executable, "-c", _EXIT_PROBE.replace('"__main__"', '"not_main"'), *argv],
                              capture_output=True, text=True)
    assert "torn down" in ordinary.stdout  # the probe can tell: an ordinary exit does run it
