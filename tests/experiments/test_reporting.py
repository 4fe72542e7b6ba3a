"""The report's speed columns and figure, from synthetic eval.json and speed.json files (no model run)."""

from pathlib import Path

import pandas as pd
import pytest

from aqflow.experiments.reporting import SPEED_COLUMNS, speed_plot_kind, speed_points, summary_table
from aqflow.io.artifacts import write_json
from aqflow.stages import report
from aqflow.stagekit.stage_cli import run_stage_module


def write(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, payload)  # with its checksum, as the stages write it
    return path


def evaluation(folder: Path, label: str, perplexity: float, init: str | None) -> Path:
    quantizer = {"init": init, "beam_size": 8} if init else {}
    return write(folder / "eval.json", {"label": label, "bits_per_parameter": 2.0 if init else 16.0,
                                        "metrics": {"wikitext2": {"perplexity": perplexity}},
                                        "settings": {"upstream": {"model": "m", "bpp": 2 if init else None,
                                                                  "quantizer": quantizer,
                                                                  "quantization_seconds": 60.0 if init else None}}})


def speed(folder: Path, devices: dict[str, dict[str, tuple[float, int, float]]]) -> Path:
    """speed.json with, per device, (decode tokens/s, resident weight bytes, prefill tokens/s) per path."""
    def path(figures):
        decode, resident, prefill = figures
        return {"decode_tokens_per_second": decode, "resident_weight_bytes": resident,
                "prefill_tokens_per_second": prefill, "peak_memory_bytes": 3 * resident}
    names = {"cuda": "NVIDIA H200", "cpu": "AMD EPYC"}
    sections = {device: {"device": device, "kind": "cpu" if device == "cpu" else "gpu", "name": names[device],
                         "paths": {name: path(figures) for name, figures in paths.items()}}
                for device, paths in devices.items()}
    first = next(iter(sections.values()))
    return write(folder / "speed.json", {"devices": sections, "disk_weight_bytes": 7, "device": first["device"],
                                         "device_name": first["name"], "paths": first["paths"]})


@pytest.fixture
def results(tmp_path):
    """Two variants and the fp baseline; speed measured for one variant (both paths on the GPU, the
    fast one on the CPU) and fp (the fast path on the GPU only)."""
    root = tmp_path / "results" / "m"
    evals = [evaluation(root / "2bpp/oaem/b8", "m/2bpp/oaem/b8+pv", 9.0, "oaem"),
             evaluation(root / "2bpp/greedy/b8", "m/2bpp/greedy/b8+pv", 10.0, "greedy"),
             evaluation(root / "fp", "m/fp", 8.0, None)]
    speeds = [speed(root / "2bpp/oaem/b8", {"cuda": {"fast": (150.0, 2 * 2**30, 900.0), "plain": (40.0, 2 * 2**30 + 5, 300.0)},
                                            "cpu": {"fast": (6.0, 2 * 2**30 + 9, 50.0)}}),
              speed(root / "fp", {"cuda": {"fast": (100.0, 6 * 2**30, 1000.0)}})]
    return tmp_path, evals, speeds


def run_report(tmp_path: Path, evals, **paths) -> int:
    out = tmp_path / "report"
    return run_stage_module(report, report.ReportSettings(), report.ReportPaths(
        evals=tuple(evals), csv=out / "summary.csv", parquet=out / "summary.parquet", pareto=out / "pareto.png",
        layers=out / "layers.png", **paths))


def test_each_row_gets_the_speed_columns_of_each_device_of_the_speed_json_beside_its_eval(results):
    tmp_path, evals, speeds = results
    plot = tmp_path / "report" / "speed.png"
    assert run_report(tmp_path, evals, speeds=tuple(speeds), speed_plot=plot) == 0
    table = pd.read_parquet(tmp_path / "report" / "summary.parquet").set_index("variant")
    assert set(SPEED_COLUMNS) <= set(table.columns)
    oaem, greedy, fp = table.loc["m/2bpp/oaem/b8+pv"], table.loc["m/2bpp/greedy/b8+pv"], table.loc["m/fp"]
    assert (oaem["decode_tokens_per_second_gpu"], oaem["decode_tokens_per_second_plain_gpu"]) == (150.0, 40.0)
    assert (oaem["prefill_tokens_per_second_gpu"], oaem["prefill_tokens_per_second_plain_gpu"]) == (900.0, 300.0)
    assert (oaem["resident_weight_bytes_gpu"], oaem["peak_memory_bytes_gpu"]) == (2 * 2**30, 6 * 2**30)
    assert (oaem["decode_tokens_per_second_cpu"], oaem["prefill_tokens_per_second_cpu"]) == (6.0, 50.0)
    assert oaem["resident_weight_bytes_cpu"] == 2 * 2**30 + 9 and pd.isna(oaem["decode_tokens_per_second_plain_cpu"])
    assert (oaem["speed_device_gpu"], oaem["speed_device_cpu"], oaem["disk_weight_bytes"]) == ("NVIDIA H200", "AMD EPYC", 7)
    assert fp["decode_tokens_per_second_gpu"] == 100.0 and pd.isna(fp["decode_tokens_per_second_plain_gpu"])
    assert pd.isna(fp["decode_tokens_per_second_cpu"]) and pd.isna(fp["speed_device_cpu"])  # no CPU section
    assert greedy[list(SPEED_COLUMNS)].isna().all()  # no speed.json in its folder
    assert plot.stat().st_size > 0 and pd.read_csv(tmp_path / "report" / "summary.csv").shape == (3, len(table.columns) + 1)

    # the figure shows the GPU where a row has a GPU figure
    assert speed_plot_kind(table) == "gpu"
    domain, points = speed_points(table.reset_index())
    assert domain == "wikitext2"
    points = points.set_index("label")
    assert sorted(points.index) == ["2bpp/oaem/b8+pv", "fp"]  # the greedy variant has no speed figure
    assert points.loc["fp", ["perplexity", "decode", "resident"]].tolist() == [8.0, 100.0, 6 * 2**30]
    assert points.loc["2bpp/oaem/b8+pv", ["decode_plain", "resident_plain"]].tolist() == [40.0, 2 * 2**30 + 5]
    # on the CPU only the variant measured there
    cpu = speed_points(table.reset_index(), "cpu")[1].set_index("label")
    assert cpu.index.tolist() == ["2bpp/oaem/b8+pv"] and cpu.loc["2bpp/oaem/b8+pv", "decode"] == 6.0


def test_the_figure_shows_the_cpu_where_no_gpu_was_measured_and_old_speed_files_still_read(tmp_path):
    root = tmp_path / "results" / "m"
    evaluation(root / "fp", "m/fp", 8.0, None)
    path = speed(root / "fp", {"cpu": {"fast": (5.0, 4 * 2**30, 40.0), "plain": (4.0, 4 * 2**30, 30.0)}})
    table = summary_table([root / "fp" / "eval.json"], [path])
    assert speed_plot_kind(table) == "cpu" and table["decode_tokens_per_second_cpu"].tolist() == [5.0]
    assert speed_points(table)[1]["decode_plain"].tolist() == [4.0]
    # a speed.json of the one-device layout (no `devices`): its section under its device's kind
    write(path, {"device": "cuda", "device_name": "NVIDIA H100", "paths": {"fast": {"decode_tokens_per_second": 90.0}},
                 "disk_weight_bytes": 7})
    old = summary_table([root / "fp" / "eval.json"], [path]).iloc[0]
    assert (old["decode_tokens_per_second_gpu"], old["speed_device_gpu"]) == (90.0, "NVIDIA H100")
    assert pd.isna(old["decode_tokens_per_second_cpu"])


def test_without_speed_files_the_report_has_no_speed_columns_and_the_figure_says_so(results):
    tmp_path, evals, _ = results
    plot = tmp_path / "report" / "speed.png"
    assert run_report(tmp_path, evals, speed_plot=plot) == 0
    table = pd.read_parquet(tmp_path / "report" / "summary.parquet")
    assert not set(SPEED_COLUMNS) & set(table.columns) and len(table) == 3
    assert speed_points(table)[1].empty and plot.stat().st_size > 0


def test_a_speed_json_without_its_eval_json_is_refused_by_name(results, capsys):
    tmp_path, evals, speeds = results
    assert run_report(tmp_path, evals[1:], speeds=tuple(speeds)) == 2
    assert str(speeds[0]) in capsys.readouterr().err
