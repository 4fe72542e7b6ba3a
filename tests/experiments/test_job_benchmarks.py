"""Per-job and per-rule costs from Snakemake's benchmark files (written here by Snakemake's own writer)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snakemake.benchmark import BenchmarkRecord, write_benchmark_records

from aqflow.experiments import job_benchmarks

REPO = Path(__file__).resolve().parents[2]


def measured(seconds: float, rss: float, cpu: float) -> BenchmarkRecord:
    record = BenchmarkRecord(running_time=seconds, max_rss=rss, max_vms=2 * rss, max_uss=rss, max_pss=rss,
                             io_in=1.5, io_out=0.5, cpu_time=cpu, cpu_usage=cpu)
    record.data_collected = True
    return record


def write(root: Path, relative: str, records: list[BenchmarkRecord], ended_at: float) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    write_benchmark_records(records, str(path), extended_fmt=False)
    os.utime(path, (ended_at, ended_at))
    return path


@pytest.fixture
def run(tmp_path):
    """Two quantize_layer jobs side by side (100-110 s and 104-110 s), a stitch after them, an
    unmeasured report (a job faster than psutil's first sample: NA) and a touched, empty file."""
    root = tmp_path / "logs" / "benchmarks"
    files = [
        write(root, "quantize_layer/tiny/2bpp/greedy/b2/model.layers.0.mlp.up_proj.tsv", [measured(10.0, 300.0, 9.0)], 110.0),
        write(root, "quantize_layer/tiny/2bpp/greedy/b2/model.layers.1.mlp.up_proj.tsv", [measured(6.0, 500.0, 5.0)], 110.0),
        write(root, "stitch/tiny/2bpp/greedy/b2.tsv", [measured(3.0, 800.0, 2.0)], 115.0),
    ]
    unmeasured = BenchmarkRecord(running_time=0.2)
    unmeasured.process_gone = True
    files.append(write(root, "report.tsv", [unmeasured], 120.0))
    touched = root / "fetch_model" / "tiny.tsv"
    touched.parent.mkdir(parents=True)
    touched.touch()
    return root, files + [touched]


def test_rule_and_job_come_from_the_path(tmp_path):
    root = tmp_path / "b"
    assert job_benchmarks.rule_and_job(root / "quantize_layer/tiny/2bpp/greedy/b2/x.y.tsv", root) == \
        ("quantize_layer", "tiny/2bpp/greedy/b2/x.y")
    assert job_benchmarks.rule_and_job(root / "report.tsv", root) == ("report", "")
    with pytest.raises(ValueError, match="ends in .tsv"):
        job_benchmarks.rule_and_job(root / "report.log", root)


def test_job_rows_read_snakemakes_columns_and_times(run):
    root, files = run
    jobs = job_benchmarks.job_table(files, root).set_index("job")
    layer0 = jobs.loc["tiny/2bpp/greedy/b2/model.layers.0.mlp.up_proj"]
    assert (layer0["rule"], layer0["wall_seconds"], layer0["max_rss_mib"], layer0["cpu_seconds"]) == \
        ("quantize_layer", 10.0, 300.0, 9.0)
    assert (layer0["io_in_mib"], layer0["io_out_mib"]) == (1.5, 0.5)
    assert (layer0["started_at"], layer0["ended_at"]) == (100.0, 110.0)
    report = jobs[jobs["rule"] == "report"].iloc[0]
    assert report["wall_seconds"] == 0.2 and math.isnan(report["max_rss_mib"]) and math.isnan(report["cpu_seconds"])
    touched = jobs[jobs["rule"] == "fetch_model"].iloc[0]
    assert math.isnan(touched["wall_seconds"]) and math.isnan(touched["started_at"])
    assert list(job_benchmarks.job_table(files, root)["rule"]) == \
        ["quantize_layer", "quantize_layer", "stitch", "report", "fetch_model"]  # by start, unmeasured last


def test_repeated_runs_average_and_keep_the_peak(tmp_path):
    path = write(tmp_path, "pvtune/a.tsv", [measured(10.0, 100.0, 8.0), measured(20.0, 300.0, 12.0)], 50.0)
    row = job_benchmarks.read_job(path, tmp_path)
    assert (row["wall_seconds"], row["cpu_seconds"], row["max_rss_mib"], row["started_at"]) == (15.0, 10.0, 300.0, 35.0)


def test_rule_table_sums_spans_and_peaks(run):
    root, files = run
    rules = job_benchmarks.rule_table(job_benchmarks.job_table(files, root)).set_index("rule")
    layers = rules.loc["quantize_layer"]
    assert (layers["jobs"], layers["measured"]) == (2, 2)
    assert (layers["wall_seconds_sum"], layers["wall_seconds_median"], layers["wall_seconds_max"]) == (16.0, 8.0, 10.0)
    assert layers["span_seconds"] == 10.0  # 100 s to 110 s: shorter than the 16 s summed, they overlapped
    assert (layers["cpu_seconds_sum"], layers["max_rss_mib"], layers["io_in_mib_sum"]) == (14.0, 500.0, 3.0)
    assert rules.loc["stitch", "span_seconds"] == 3.0
    assert (rules.loc["fetch_model", "jobs"], rules.loc["fetch_model", "measured"]) == (1, 0)
    assert math.isnan(rules.loc["fetch_model", "wall_seconds_sum"]) and math.isnan(rules.loc["fetch_model", "max_rss_mib"])
    assert list(rules.index) == ["quantize_layer", "stitch", "report", "fetch_model"]
    assert job_benchmarks.run_span_seconds(job_benchmarks.job_table(files, root)) == 20.0  # 100 s to 120 s


def test_stage_times_script_reads_a_benchmark_folder(run, tmp_path):
    root, _ = run
    out = tmp_path / "stage_times.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "benchmarks.run_stats", "stages", str(root), "--json", str(out)],
                            capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "quantize_layer" in result.stdout and "first job start to last job end: 20 s" in result.stdout
    summary = json.loads(out.read_text())
    by_rule = {row["rule"]: row for row in summary["rules"]}
    assert by_rule["quantize_layer"]["wall_seconds_sum"] == 16.0 and by_rule["stitch"]["max_rss_mib"] == 800.0
    assert by_rule["fetch_model"]["wall_seconds_sum"] is None  # NaN is written as null
    assert summary["first_start_to_last_end_seconds"] == 20.0


def test_the_gpu_sample_log_gives_each_cards_share_of_busy_samples():
    """benchmarks/run_stats cards: per card in a window, the share of busy samples and their mean."""
    from datetime import datetime, timedelta

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.run_stats import per_card

    start = datetime(2026, 1, 1)
    samples = [{"time": start + timedelta(seconds=second), "card": card, "utilisation": value, "memory_mib": 10.0 * second}
               for second, values in enumerate([(0, 50), (20, 0), (40, 0), (0, 100)]) for card, value in zip("01", values)]
    rows = per_card(samples, start + timedelta(seconds=1), start + timedelta(seconds=3))
    assert [(row["card"], row["samples"], row["busy_share"], row["mean_utilisation"], row["peak_memory_mib"])
            for row in rows] == [("0", 3, 2 / 3, 20.0, 30.0), ("1", 3, 1 / 3, 100 / 3, 30.0)]
