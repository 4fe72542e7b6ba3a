"""The tiny-model DAG on a real one-node Slurm (tests/slurm_node.py), every job submitted through
`--profile profiles/slurm` (the Slurm executor plugin) and checked in Slurm's own records; a few
jobs through `--profile profiles/cluster-generic` (its sbatch line) too.

The jobs ask for the GPUs that config.yaml and the profile give each rule; the test node declares
two GPUs to Slurm (without CUDA behind them), so the requests are scheduled and recorded as on a GPU
cluster while the computation runs on the CPU. Memory and CPUs are shrunk to fit this machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_node import SlurmNode, ensure_installed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "workflow" / "config.tiny.yaml"
SLURM_PROFILE = REPO / "profiles" / "slurm"
GENERIC_PROFILE = REPO / "profiles" / "cluster-generic"
# rule -> its key in config.yaml resources
RESOURCE_KEY = {"fetch_model": "fetch_model", "fetch_data": "fetch_data", "calibrate": "calibrate",
                "quantize_layer": "quantize_layer", "stitch": "stitch", "evaluate_quantized": "evaluate",
                "evaluate_fp": "evaluate", "pvtune": "pvtune", "evaluate_pvtuned": "evaluate", "report": "report"}
GPU_RULES = {"calibrate", "quantize_layer", "evaluate_quantized", "evaluate_fp", "pvtune", "evaluate_pvtuned"}


def configured_gpus(rule: str) -> int:
    """GPUs a rule's job asks for under profiles/slurm: the profile's set-resources, else config.yaml."""
    resources = yaml.safe_load((REPO / "config.yaml").read_text())["resources"]
    merged = resources["default"] | resources.get(RESOURCE_KEY[rule], {})
    profile = yaml.safe_load((SLURM_PROFILE / "config.yaml").read_text()).get("set-resources", {})
    return int(profile.get(rule, {}).get("gpu", merged["gpu"]))


def test_default_config_asks_gpus_for_the_compute_rules_only():
    """Without any test override: calibrate, quantize, evaluate (and pvtune) ask for GPUs."""
    for rule in RESOURCE_KEY:
        assert (configured_gpus(rule) > 0) == (rule in GPU_RULES), rule
    profile = yaml.safe_load((SLURM_PROFILE / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    assert profile["set-resources"]["pvtune"]["gpu"] >= 1 and profile["set-resources"]["calibrate"]["nodes"] == 1
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    assert config["resources"]["pvtune"]["gpu"] >= 1


def test_dry_run_jobs_carry_the_gpu_requests(tmp_path):
    """What the executor submits comes from the job's resources: check them in a dry run of the real
    config (no test override) through the Slurm profile."""
    layer = "results/tiny/2bpp/greedy/b8/layers/model.layers.0.self_attn.q_proj.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile", str(SLURM_PROFILE),
         "--configfile", str(REPO / "config.yaml"), "--directory", str(tmp_path), "--dry-run",
         "--slurm-no-account", layer, "results/tiny/fp/eval.json"],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = re.findall(r"^(?:rule|checkpoint) (\w+):\n(?:    .*\n)*?    resources: (.*)$", result.stdout, flags=re.M)
    seen = {}
    for rule, resources in jobs:
        seen[rule] = int(re.search(r"\bgpu=(\d+)", resources).group(1))
    assert set(seen) == {"fetch_model", "fetch_data", "calibrate", "quantize_layer", "evaluate_fp"}
    assert seen == {rule: configured_gpus(rule) for rule in seen}
    assert seen["calibrate"] == 2 and seen["quantize_layer"] == 1 and seen["fetch_model"] == 0


# --- the real cluster -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm():
    ensure_installed()
    node = SlurmNode()
    try:
        node.start()
        yield node
    finally:
        node.stop()


def cluster_config(path: Path) -> Path:
    """The tiny config, one variant, one task; every rule's GPU request as configured, memory and
    CPUs small enough for this machine."""
    config = yaml.safe_load(TINY.read_text())
    config["targets"] = config["targets"][:1]
    config["evaluation"]["tasks"] = ["arc_easy"]
    real = yaml.safe_load((REPO / "config.yaml").read_text())["resources"]
    config["resources"] = {key: {"mem_mb": 1000, "runtime": 30, "cpus": 1, "gpu": (real["default"] | real.get(key, {}))["gpu"]}
                           for key in set(real) | set(RESOURCE_KEY.values())}
    path.write_text(yaml.safe_dump(config))
    return path


def run_snakemake(node: SlurmNode, workdir: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(node.env, AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile", str(profile),
               "--configfile", str(cluster_config(workdir / "cluster.yaml")), "--directory", str(workdir),
               "--latency-wait", "5", "--seconds-between-status-checks", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=2400)


def job_logs(workdir: Path) -> str:
    """The tails of the Slurm job logs of a run (for failure messages)."""
    logs = sorted((workdir / ".snakemake").rglob("*.log"))
    return "\n".join(f"--- {path}\n{path.read_text(errors='replace')[-1500:]}" for path in logs[-6:])


def rule_of(comment: str) -> str:
    """The plugin's job comment is rule_<rule>[_wildcards_<...>]."""
    assert comment.startswith("rule_"), comment
    return comment[len("rule_"):].split("_wildcards_")[0]


def gpus_of(job: dict[str, str]) -> int:
    match = re.search(r"gpu:(\d+)", job.get("TresPerJob", "") + job.get("TresPerNode", ""))
    return int(match.group(1)) if match else 0


@pytest.mark.slow
@pytest.mark.slurm
def test_every_job_of_the_dag_runs_as_a_slurm_job(slurm, tmp_path):
    result = run_snakemake(slurm, tmp_path, SLURM_PROFILE, "--slurm-no-account", "--slurm-status-command", "squeue",
                           "--slurm-init-seconds-before-status-checks", "1", "--slurm-keep-successful-logs")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + job_logs(tmp_path) + slurm.logs()
    run_id = re.search(r"SLURM run ID: (\S+)", output).group(1)
    submitted = set(re.findall(r"has been submitted with SLURM jobid (\d+)", output))

    jobs = {job_id: job for job_id, job in slurm.jobs().items() if job.get("JobName") == run_id}
    assert set(jobs) == submitted and submitted
    by_rule: dict[str, list[str]] = {}
    for job_id, job in jobs.items():
        by_rule.setdefault(rule_of(job["Comment"]), []).append(job_id)
    assert {rule: len(ids) for rule, ids in by_rule.items()} == {
        "fetch_model": 1, "fetch_data": 2, "calibrate": 1, "quantize_layer": 14, "stitch": 1,
        "evaluate_quantized": 1, "evaluate_fp": 1, "pvtune": 1, "evaluate_pvtuned": 1, "report": 1}

    completions = slurm.completions()
    for rule, ids in by_rule.items():
        for job_id in ids:
            assert jobs[job_id]["JobState"] == "COMPLETED" and jobs[job_id]["ExitCode"] == "0:0", jobs[job_id]
            assert completions[job_id]["state"] == "COMPLETED" and completions[job_id]["exit_code"] == "0:0"
            assert completions[job_id]["nodes"] == slurm.host
            assert gpus_of(jobs[job_id]) == configured_gpus(rule), (rule, jobs[job_id])
            # the job's own log, written by Slurm on the node (the jobstep ran the rule there)
            logs = list((tmp_path / ".snakemake" / "slurm_logs" / f"rule_{rule}").rglob(f"{job_id}.log"))
            assert len(logs) == 1, (rule, job_id)

    record = json.loads((tmp_path / "results/tiny/2bpp/greedy/b2e2/eval.json").read_text())
    assert len(record["settings"]["upstream"]["layers"]) == 14
    assert (tmp_path / "results/report/summary.csv").stat().st_size > 0
    # calibrate got two GPUs from Slurm, so it sharded its windows over two processes
    calibration = next((tmp_path / "results/tiny/calib").glob("*/calibration.json"))
    assert json.loads(calibration.read_text())["devices"] == ["cpu", "cpu"]
    # pvtune got two GPUs from the profile, so it ran as two torchrun processes
    pvtune_log = (tmp_path / "logs/pvtune/tiny/2bpp/greedy/b2e2.log").read_text().splitlines()[0]
    assert "torch.distributed.run" in pvtune_log and "--nproc-per-node=2" in pvtune_log, pvtune_log


@pytest.mark.slow
@pytest.mark.slurm
def test_cluster_generic_profile_submits_its_sbatch_line(slurm, tmp_path):
    before = set(slurm.completions())
    result = run_snakemake(slurm, tmp_path, GENERIC_PROFILE,
                           "--cluster-generic-status-cmd", str(GENERIC_PROFILE / "status.sh"),
                           "results/tiny/calib/c4-standin-n8-t64-s0-fp")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + job_logs(tmp_path) + slurm.logs()
    submitted = set(re.findall(r"Submitted job \d+ with external jobid '(\d+)", output))
    assert len(submitted) == 3, output[-3000:]
    jobs = slurm.jobs()
    completions = slurm.completions()
    assert submitted <= set(completions) - before
    rules = {jobs[job_id]["JobName"].removeprefix("aqflow-"): job_id for job_id in submitted}
    assert sorted(rules) == ["calibrate", "fetch_data", "fetch_model"]
    for rule, job_id in rules.items():
        assert completions[job_id]["state"] == "COMPLETED" and jobs[job_id]["ExitCode"] == "0:0"
        # config.yaml's GPUs (this profile has no set-resources): 1 for calibrate, none for fetching
        real = yaml.safe_load((REPO / "config.yaml").read_text())["resources"]
        assert gpus_of(jobs[job_id]) == (real["default"] | real.get(RESOURCE_KEY[rule], {}))["gpu"], rule
    assert gpus_of(jobs[rules["calibrate"]]) == 1
    assert (tmp_path / "results/tiny/calib/c4-standin-n8-t64-s0-fp/calibration.json").exists()
