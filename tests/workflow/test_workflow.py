"""The whole Snakemake DAG on CPU with a tiny random model: it runs, and reruns only what changed."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "workflow" / "config.tiny.yaml"
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]
VARIANT = "results/tiny/2bpp/greedy/b2e2"


def snakemake(workdir: Path, *args: str, config: Path = CONFIG) -> subprocess.CompletedProcess:
    env = dict(os.environ, AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))
    return subprocess.run([*SNAKEMAKE, "--configfile", str(config), "--directory", str(workdir), *args],
                          capture_output=True, text=True, env=env, timeout=1800)


def planned_jobs(workdir: Path, *args: str, config: Path = CONFIG) -> dict[str, int]:
    """rule -> job count of a dry run."""
    result = snakemake(workdir, "-n", "--quiet", "rules", *args, config=config)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = {}
    for line in result.stdout.splitlines():
        match = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if match and match.group(1) not in ("total", "all"):
            counts[match.group(1)] = int(match.group(2))
    return counts


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dag")
    result = snakemake(workdir, "--cores", "2")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return workdir


def edited_config(workdir: Path, section: str, key: str, value) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config.setdefault(section, {})[key] = value
    path = workdir / f"config.{section}.{key}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_dag_runs_end_to_end_and_writes_a_sane_eval(finished_run):
    record = json.loads((finished_run / VARIANT / "eval.json").read_text())
    ppl = record["metrics"]["wikitext2-standin"]["perplexity"]
    assert 1 < ppl < 10 * 512  # a random model over a ~500-token vocabulary
    layers = record["settings"]["upstream"]["layers"]
    # what the float32 tiny checkpoint stores: int8 codes (2 per group of 8), 2 x 64 x 8 float32
    # codebook values per layer, one float32 scale per row
    stored = sum(l["out_features"] * l["in_features"] // 8 * 2 * 8 + 2 * 64 * 8 * 32 + l["out_features"] * 32 for l in layers)
    weights = sum(l["out_features"] * l["in_features"] for l in layers)
    assert record["bits_per_parameter"] == pytest.approx(stored / weights)
    assert set(record["metrics"]["tasks"]) == {"arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "lambada_openai"}
    assert len(layers) == 14 and all(layer["final_relative_mse"] < layer["init_relative_mse"] for layer in layers)
    # PV-tuning is on in the tiny config: eval.json is the PV-tuned model's, the stitched model's
    # evaluation is embedded whole (metrics, settings, timings), and so is the PV-tuning record
    assert record["model_dir"].endswith(f"{VARIANT}/pv/model") and record["label"].endswith("+pv")
    pre = record["pre_pv"]
    assert pre["model_dir"].endswith(f"{VARIANT}/model") and pre["timings"]["total_seconds"] > 0
    assert pre == json.loads((finished_run / VARIANT / "eval_pre_pv.json").read_text())
    pvtune = record["settings"]["upstream"]["pvtune"]
    assert pvtune["settings"]["max_code_change_fraction"] == 0.05 and pvtune["timings"]["train_seconds"] > 0
    assert pvtune["data"]["role"] == "calibration" and pvtune["best_heldout_kl"] <= pvtune["initial_heldout_kl"]
    log = pd.read_parquet(finished_run / VARIANT / "pv" / "train_log.parquet")
    assert {"step", "split", "kl", "perplexity", "codes_changed_fraction", "seconds", "selected"} <= set(log.columns)
    summary = pd.read_csv(finished_run / "results/report/summary.csv")
    assert set(summary["init"]) == {"greedy", "oaem", "fp"}
    quantized = summary[summary["init"] != "fp"]
    assert quantized["pv_tuned"].all() and quantized["pre_pv_wikitext2-standin_ppl"].notna().all()
    assert (finished_run / "results/report/pareto.png").stat().st_size > 0
    assert (finished_run / "results/report/pvtune.png").stat().st_size > 0
    assert (finished_run / VARIANT / "model" / "config.json").exists()
    assert planned_jobs(finished_run) == {}  # nothing left to do
    report = snakemake(finished_run, "--report", str(finished_run / "report.html"))
    assert report.returncode == 0, report.stderr[-3000:]
    html = (finished_run / "report.html").read_text(errors="ignore")
    assert "summary.csv" in html and "pareto.png" in html and "layers.png" in html and "pvtune.png" in html
    assert "stage_times.csv" in html
    # the description names the corpus each model was calibrated on (the config has no single one)
    assert "calibrated on its model's corpus (tiny: c4-standin)" in html


def assert_report_times_every_job(workdir: Path) -> pd.DataFrame:
    """Every job wrote its benchmark file (logs/benchmarks/<rule>/...tsv), and the report's
    stage_times.csv counts each one: all of them but the report's own, written after it."""
    root = workdir / "logs" / "benchmarks"
    written: dict[str, int] = {}
    for path in root.rglob("*.tsv"):
        rule = path.relative_to(root).with_suffix("").parts[0]
        written[rule] = written.get(rule, 0) + 1
    assert written.pop("report") == 1
    times = pd.read_csv(workdir / "results/report/stage_times.csv").set_index("rule")
    assert times["jobs"].to_dict() == written
    assert (times["measured"] == times["jobs"]).all() and (times["wall_seconds_sum"] > 0).all()
    assert (times["wall_seconds_max"] <= times["wall_seconds_sum"]).all()
    assert times.loc["quantize_layer", "max_rss_mib"] > 100  # a Python process with torch loaded
    return times


@pytest.mark.slow
def test_report_times_every_rule_from_its_benchmark_files(finished_run):
    times = assert_report_times_every_job(finished_run)
    # two corpora: c4-standin calibrates, wikitext2-standin evaluates
    assert times["jobs"].to_dict() == {"fetch_model": 1, "fetch_data": 2, "calibrate": 1, "quantize_layer": 28,
                                       "stitch": 2, "evaluate_quantized": 2, "pvtune": 2, "evaluate_pvtuned": 2,
                                       "evaluate_fp": 1}


@pytest.mark.slow
def test_quantization_setting_reruns_quantize_and_after_not_calibrate(finished_run):
    jobs = planned_jobs(finished_run, config=edited_config(finished_run, "quantization", "steps_per_epoch", 21))
    assert "calibrate" not in jobs and "fetch_model" not in jobs
    assert jobs["quantize_layer"] == 28 and jobs["stitch"] == 2 and jobs["evaluate_quantized"] == 2
    assert jobs["pvtune"] == 2 and jobs["evaluate_pvtuned"] == 2
    assert "evaluate_fp" not in jobs


@pytest.mark.slow
def test_pvtune_setting_reruns_only_pvtune_and_after(finished_run):
    jobs = planned_jobs(finished_run, config=edited_config(finished_run, "pvtune", "code_lr", 2.0e-3))
    assert jobs == {"pvtune": 2, "evaluate_pvtuned": 2, "report": 1}


@pytest.mark.slow
def test_execution_settings_rerun_nothing_and_evaluation_settings_rerun_the_evaluations(finished_run):
    """The logits budget reaches the evaluations through their `execution` param, which Snakemake
    leaves out of its rerun check (no builtin value): changing how a job runs replans nothing. The
    same evaluations replan when what they measure changes."""
    for key, value in (("logits_budget_gib", 0.5), ("warm_worker_idle_seconds", 3), ("warm_workers", True)):
        assert planned_jobs(finished_run, config=edited_config(finished_run, "execution", key, value)) == {}, key
    jobs = planned_jobs(finished_run, config=edited_config(finished_run, "evaluation", "context", 32))
    assert jobs == {"evaluate_fp": 1, "evaluate_quantized": 2, "evaluate_pvtuned": 2, "report": 1}


@pytest.mark.slow
def test_calibration_setting_reruns_everything_downstream(finished_run, tmp_path):
    """Run it for real (the layer list after a new calibration is only known once it has run):
    every layer, checkpoint and evaluation is rewritten, the fetched model and data are not."""
    workdir = tmp_path / "copy"
    shutil.copytree(finished_run, workdir, symlinks=True)
    config = edited_config(workdir, "calibration", "num_windows", 6)
    jobs = planned_jobs(workdir, config=config)
    assert jobs["calibrate"] == 1 and "fetch_model" not in jobs and "fetch_data" not in jobs
    before = {p: p.stat().st_mtime_ns for p in (workdir / "results").rglob("*") if p.is_file()}
    result = snakemake(workdir, "--cores", "2", config=config)
    assert result.returncode == 0, result.stderr[-3000:]
    layers = [p for p in before if p.suffix == ".safetensors" and "/layers/" in str(p)]
    assert len(layers) == 28 and all(p.stat().st_mtime_ns > before[p] for p in layers)
    for variant in ("greedy", "oaem"):
        assert (workdir / f"results/tiny/2bpp/{variant}/b2e2/eval.json").stat().st_mtime_ns > before[workdir / f"results/tiny/2bpp/{variant}/b2e2/eval.json"]
    assert (workdir / "results/tiny/fp/eval.json").stat().st_mtime_ns == before[workdir / "results/tiny/fp/eval.json"]


@pytest.mark.slow
def test_deleting_one_layer_reruns_only_that_layer_and_what_follows(finished_run):
    layer = finished_run / VARIANT / "layers" / "model.layers.1.mlp.down_proj.safetensors"
    layer.unlink()
    jobs = planned_jobs(finished_run)
    assert jobs == {"quantize_layer": 1, "stitch": 1, "evaluate_quantized": 1, "pvtune": 1, "evaluate_pvtuned": 1,
                    "report": 1}


@pytest.mark.slow
def test_a_missing_timing_reruns_no_job(finished_run, tmp_path):
    """Results made before benchmark files existed, or with logs/ cleaned: nothing reruns, and the
    report (when it runs for another reason) counts the timings that are there."""
    workdir = tmp_path / "copy"
    shutil.copytree(finished_run, workdir, symlinks=True)
    result = snakemake(workdir, "--cores", "2")  # up to date first (other tests of the module edit the run)
    assert result.returncode == 0, result.stderr[-3000:]
    for tsv in (workdir / "logs" / "benchmarks" / "quantize_layer").rglob("*.tsv"):
        tsv.unlink()
    assert planned_jobs(workdir) == {}
    (workdir / "results/report/summary.csv").unlink()
    assert planned_jobs(workdir) == {"report": 1}
    result = snakemake(workdir, "--cores", "1", "results/report/summary.csv")
    assert result.returncode == 0, result.stderr[-3000:]
    times = pd.read_csv(workdir / "results/report/stage_times.csv").set_index("rule")
    assert "quantize_layer" not in times.index and times.loc["stitch", "jobs"] == 2


# the fast path only, a few tokens (on this GPU-less box `devices: [auto]` is the CPU, which decodes
# cpu_new_tokens): aqlm's own CPU kernel (the plain path) compiles for half a minute per process; the
# stage's own test measures it
SPEED = {"enabled": True, "paths": ["fast"], "prompt_tokens": 4, "new_tokens": 8, "cpu_new_tokens": 8,
         "warmup_tokens": 1, "prefill_tokens": 16, "cpu_prefill_tokens": 16, "repeats": 1}


def speed_config(directory: Path, **changes) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config["speed"] = {**SPEED, **changes}
    path = directory / f"config.speed{''.join(f'.{k}{v}' for k, v in changes.items())}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_speed_on_plans_one_speed_job_per_target_and_baseline_and_off_none(tmp_path):
    """The report asks for them (and `snakemake` does: the finished-run test below); from an empty
    folder only a named report's plan is complete before the calibration checkpoint has run."""
    on = planned_jobs(tmp_path, "--", "results/report/summary.csv", config=speed_config(tmp_path))
    assert (on["speed"], on["speed_fp"], on["evaluate_pvtuned"]) == (2, 1, 2)
    off = planned_jobs(tmp_path, "--", "results/report/summary.csv")
    assert "speed" not in off and "speed_fp" not in off and off["evaluate_pvtuned"] == 2


@pytest.mark.slow
def test_speed_runs_per_target_and_baseline_and_reruns_alone_for_its_settings(finished_run, tmp_path):
    """Turning speed on in a finished run adds its jobs and the report's rerun, nothing else; they
    run on the CPU (the PV-tuned checkpoints, the fp model) into the report; a changed speed
    setting replans them alone."""
    workdir = tmp_path / "copy"
    shutil.copytree(finished_run, workdir, symlinks=True)
    assert snakemake(workdir, "--cores", "2").returncode == 0  # up to date first (other tests edit the run)
    config = speed_config(workdir)
    assert planned_jobs(workdir, config=config) == {"speed": 2, "speed_fp": 1, "report": 1}
    result = snakemake(workdir, "--cores", "2", config=config)
    assert result.returncode == 0, result.stderr[-3000:]
    # each variant's PV-tuned checkpoint (what its eval.json evaluates), and the source model
    measured = {VARIANT: f"{VARIANT}/pv/model", "results/tiny/2bpp/oaem/b2e2": "results/tiny/2bpp/oaem/b2e2/pv/model",
                "results/tiny/fp": "resources/models/tiny"}
    for folder, model in measured.items():
        record = json.loads((workdir / folder / "speed.json").read_text())
        assert record["model_dir"] == model and list(record["devices"]) == ["cpu"]
        assert record["devices"]["cpu"]["paths"]["fast"]["decode"]["new_tokens"] == 8
    summary = pd.read_csv(workdir / "results/report/summary.csv")
    assert summary["decode_tokens_per_second_cpu"].gt(0).all() and summary["resident_weight_bytes_cpu"].gt(0).all()
    assert summary["decode_tokens_per_second_gpu"].isna().all()
    assert (workdir / "results/report/speed.png").stat().st_size > 0
    assert planned_jobs(workdir, config=config) == {}
    assert planned_jobs(workdir, config=speed_config(workdir, cpu_new_tokens=9)) == {"speed": 2, "speed_fp": 1, "report": 1}


SEQUENTIAL_VARIANT = "results/tiny/2bpp/greedy/b2e2"


def sequential_config(directory: Path) -> Path:
    """The tiny config in sequential mode with block fine-tuning, one target."""
    config = yaml.safe_load(CONFIG.read_text())
    config["targets"] = [{"model": "tiny", "bpp": 2, "init": "greedy", "beam": 2, "epochs": 2}]
    config["calibration"]["propagation"] = "sequential"
    config["calibration"]["block_finetune"] = {"enabled": True, "epochs": 2, "lr": 1.0e-3, "batch_size": 4, "seed": 0}
    path = directory / "config.sequential.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def sequential_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dag-sequential")
    config = sequential_config(workdir)
    result = snakemake(workdir, "--cores", "2", config=config)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return workdir, config


@pytest.mark.slow
def test_sequential_dag_runs_end_to_end_and_records_the_mode(sequential_run):
    workdir, config = sequential_run
    record = json.loads((workdir / SEQUENTIAL_VARIANT / "eval.json").read_text())
    assert 1 < record["metrics"]["wikitext2-standin"]["perplexity"] < 10 * 512
    upstream = record["settings"]["upstream"]
    assert upstream["calibration"]["propagation"] == "sequential"
    layers = upstream["layers"]
    assert len(layers) == 14 and all(layer["final_relative_mse"] < layer["init_relative_mse"] for layer in layers)
    tuned = upstream["block_finetune"]
    assert [b["block"] for b in tuned] == [0, 1]
    assert all(b["relative_mse_after"] < b["relative_mse_before"] for b in tuned)
    summary = pd.read_csv(workdir / "results/report/summary.csv").set_index("init")
    assert summary.loc["greedy", "propagation"] == "sequential" and summary.loc["greedy", "block_finetune"]
    shared = next((workdir / "results/tiny/calib").iterdir())
    assert json.loads((shared / "calibration.json").read_text())["propagation"] == "sequential"
    assert sorted(p.name for p in shared.glob("block*.npz")) == ["block0.npz"]  # block 1 is the variant's
    block1 = json.loads((workdir / SEQUENTIAL_VARIANT / "calib/block1/calibration.json").read_text())
    assert block1["propagation"] == "sequential" and block1["block_finetuned"]
    assert not list((workdir / SEQUENTIAL_VARIANT / "calib").glob("*.inputs.safetensors"))  # temporary
    stitched = json.loads((workdir / SEQUENTIAL_VARIANT / "model/aqflow_model.json").read_text())
    assert "model.layers.1.input_layernorm.weight" in stitched["replaced_tensors"]  # the tuned norms
    assert planned_jobs(workdir, config=config) == {}  # nothing left to do, though the inputs are gone
    times = assert_report_times_every_job(workdir)
    assert (times.loc["calibrate_block", "jobs"], times.loc["finetune_block", "jobs"]) == (1, 2)  # blocks 1; 0 and 1


@pytest.mark.slow
def test_sequential_block0_equals_fp_and_block1_does_not(sequential_run, tmp_path):
    """Calibrate the same model on the same corpus in fp mode by hand: block 0 is the same XᵀX,
    block 1 (calibrated on quantized block 0's outputs) is not."""
    from aqflow.calibration import load_block_xtx
    from aqflow.stages import calibrate

    workdir, _ = sequential_run
    fp_dir = tmp_path / "fp"
    assert calibrate.main(["--model-dir", str(workdir / "resources/models/tiny"),
                           "--corpus", str(workdir / "resources/data/c4-standin.parquet"), "--output-dir", str(fp_dir),
                           "--num-windows", "8", "--window-tokens", "64", "--seed", "0", "--propagation", "fp",
                           "--batch-size", "4", "--quiet"]) == 0
    shared = next((workdir / "results/tiny/calib").iterdir())
    fp0, seq0 = load_block_xtx(fp_dir / "block0.npz"), load_block_xtx(shared / "block0.npz")
    fp1 = load_block_xtx(fp_dir / "block1.npz")
    seq1 = load_block_xtx(workdir / SEQUENTIAL_VARIANT / "calib/block1/block1.npz")
    assert fp0.xtx.keys() == seq0.xtx.keys() == fp1.xtx.keys() == seq1.xtx.keys()
    for site in fp0.xtx:
        assert torch.equal(fp0.xtx[site], seq0.xtx[site])
        assert seq1.tokens[site] == fp1.tokens[site] == 8 * 64
        assert (seq1.xtx[site] - fp1.xtx[site]).norm() > 1e-3 * fp1.xtx[site].norm()


@pytest.mark.slow
def test_sequential_quantizer_change_reruns_blocks_after_the_first_not_fetch(sequential_run):
    workdir, config = sequential_run
    changed = yaml.safe_load(config.read_text())
    changed["quantization"]["steps_per_epoch"] = 21
    path = workdir / "config.sequential.steps.yaml"
    path.write_text(yaml.safe_dump(changed))
    jobs = planned_jobs(workdir, config=path)
    assert jobs == {"quantize_layer": 14, "calibrate_block": 1, "finetune_block": 2, "stitch": 1,
                    "evaluate_quantized": 1, "pvtune": 1, "evaluate_pvtuned": 1,
                    "report": 1}  # not fetch_*, not the shared calibrate


@pytest.mark.slow
def test_sequential_finetune_change_keeps_block0_layers(sequential_run):
    """Block 0's layers come from the shared fp calibration: tuning settings change only what
    runs on tuned blocks (block 1's calibration and layers), not block 0's quantization."""
    workdir, config = sequential_run
    changed = yaml.safe_load(config.read_text())
    changed["calibration"]["block_finetune"]["epochs"] = 3
    path = workdir / "config.sequential.finetune.yaml"
    path.write_text(yaml.safe_dump(changed))
    jobs = planned_jobs(workdir, config=path)
    assert jobs == {"finetune_block": 2, "calibrate_block": 1, "quantize_layer": 7, "stitch": 1,
                    "evaluate_quantized": 1, "pvtune": 1, "evaluate_pvtuned": 1, "report": 1}


@pytest.mark.slow
def test_sequential_deleted_layer_recomputes_the_temporary_block_inputs(sequential_run, tmp_path):
    """Block 1's inputs were temporary: requantizing one of its layers (which its fine-tuning needs
    again) recalibrates block 1 from the kept tuned block 0, so all of block 1 reruns; block 0 does not."""
    workdir, config = sequential_run
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy, symlinks=True)
    (copy / SEQUENTIAL_VARIANT / "layers" / "model.layers.1.mlp.down_proj.safetensors").unlink()
    assert planned_jobs(copy, config=config) == {"calibrate_block": 1, "quantize_layer": 7, "finetune_block": 1,
                                                 "stitch": 1, "evaluate_quantized": 1, "pvtune": 1,
                                                 "evaluate_pvtuned": 1, "report": 1}


def test_block_finetune_needs_sequential_mode(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())
    config["calibration"]["block_finetune"] = {"enabled": True}
    path = tmp_path / "fp-finetune.yaml"
    path.write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, "-n", config=path)
    assert result.returncode != 0 and "block_finetune" in result.stdout + result.stderr


def test_config_typo_names_the_key(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())
    config["quantization"]["beam_sise"] = 4
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, "-n", config=path)
    assert result.returncode != 0
    assert "beam_sise" in result.stdout + result.stderr


def test_lint_and_format_are_clean():
    lint = subprocess.run([*SNAKEMAKE, "--lint", "--configfile", str(CONFIG)], capture_output=True, text=True, cwd=REPO)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-3000:]
    fmt = subprocess.run([shutil.which("snakefmt", path=str(Path(sys.executable).parent)) or "snakefmt", "--check",
                          str(REPO / "Snakefile"), str(REPO / "workflow")], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout[-3000:] + fmt.stderr[-3000:]


def test_dag_and_rulegraph_render():
    for what in ("--dag", "--rulegraph"):
        result = subprocess.run([*SNAKEMAKE, what, "--configfile", str(CONFIG)], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0 and "digraph" in result.stdout, result.stderr[-3000:]
