"""`--config overrides=FILE[,FILE]` layers a user's settings over a profile's config files
(dry runs through the Snakemake CLI, as a user types them)."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """`snakemake --profile profiles/demo -n ARGS` from the repository (where the profile's
    relative config paths point), working in `workdir`."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile", "profiles/demo",
                           "--directory", str(workdir), "-n", *args],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


def calibration_dirs(result: subprocess.CompletedProcess) -> set[str]:
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return set(re.findall(r"results/[^/\s]+/calib/[^/\s,;]+", result.stdout))


def test_override_files_layer_over_the_profile_in_order(tmp_path):
    # the profile alone: config.yaml with demo.yaml's 32 x 512-token calibration windows
    assert calibration_dirs(dry_run(tmp_path / "a")) == {"results/smollm2/calib/c4-standin-n32-t512-s0-fp"}
    first = tmp_path / "first.yaml"
    first.write_text("calibration: {num_windows: 16, seed: 5}\ntargets: [{model: tiny, bpp: 2, init: greedy, beam: 2}]\n")
    second = tmp_path / "second.yaml"
    second.write_text("calibration: {seed: 7}\n")
    # targets before --config (its values would swallow them); demo.yaml's window_tokens stays,
    # the first file's window count and target apply, the later file's seed wins
    result = dry_run(tmp_path / "b", "results/tiny/2bpp/greedy/b2/eval.json", "--config", f"overrides={first},{second}")
    assert calibration_dirs(result) == {"results/tiny/calib/c4-standin-n16-t512-s7-fp"}
    # the same files as a YAML list, and the targets of the override (no target on the command line)
    result = dry_run(tmp_path / "c", "--config", f"overrides=[{first}]")
    assert calibration_dirs(result) == {"results/tiny/calib/c4-standin-n16-t512-s5-fp"}


def test_overrides_are_validated_after_merging_and_a_missing_file_is_named(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("calibration: {num_windos: 16}\n")
    result = dry_run(tmp_path / "a", "--config", f"overrides={typo}")
    assert result.returncode != 0 and "num_windos" in result.stdout + result.stderr
    moved = tmp_path / "moved.yaml"  # a key of an older config.yaml that now lives in execution
    moved.write_text("evaluation: {cpu_kernel: dense}\n")
    result = dry_run(tmp_path / "m", "--config", f"overrides={moved}")
    assert result.returncode != 0 and "evaluation.cpu_kernel is now execution.cpu_kernel" in result.stdout + result.stderr
    result = dry_run(tmp_path / "b", "--config", f"overrides={tmp_path / 'absent.yaml'}")
    assert result.returncode != 0 and "absent.yaml does not exist" in result.stdout + result.stderr


def test_a_configfile_next_to_a_profile_with_files_is_refused_in_one_line(tmp_path):
    """Snakemake's --configfile replaces the profile's configfile list (its command line wins over a
    profile's values): refused, naming the files it would drop and the way that keeps them."""
    mine = tmp_path / "small.yaml"
    mine.write_text("calibration: {num_windows: 16}\n")
    result = dry_run(tmp_path / "a", "--configfile", str(mine))
    refusal = [line for line in result.stderr.splitlines() if line.startswith("aqflow:")]
    assert result.returncode != 0 and len(refusal) == 1 and "Failed validating" not in result.stderr
    assert (f"--configfile {mine} would replace profile profiles/demo's configfile list "
            f"(config.yaml, profiles/demo/demo.yaml)") in refusal[0]
    assert f"`--config overrides={mine}`" in refusal[0]
    # the advice, literally: config.yaml, demo.yaml's 512-token windows, then the file's 16 windows
    result = dry_run(tmp_path / "b", "--config", f"overrides={mine}")
    assert calibration_dirs(result) == {"results/smollm2/calib/c4-standin-n16-t512-s0-fp"}


def test_a_missing_base_config_is_one_line_not_a_schema_dump(tmp_path):
    """Run from a folder without config.yaml, a partial --configfile is all there is: one line naming
    what is missing and where config.yaml was looked for."""
    partial = tmp_path / "partial.yaml"
    partial.write_text("targets: [{model: tiny, bpp: 2, init: greedy, beam: 2}]\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    result = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile",
                             str(partial), "-n"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Failed validating" not in output and len(output.splitlines()) < 5, output
    assert (f"aqflow: config: the top level: 'models' is a required property; config.yaml, the base the other "
            f"files are layered over, is read from the working directory ({tmp_path}) and is not there") in output
