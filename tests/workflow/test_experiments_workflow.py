"""The experiment grid as a pipeline target: every cell an ordinary variant path, planned by a dry run."""

import csv
import subprocess
from pathlib import Path

import pytest
import yaml

from snakemake_runs import REPO, snakemake

TINY = yaml.safe_load((REPO / "tests" / "workflow" / "config.tiny.yaml").read_text())


def dry_run(tmp_path: Path, grid: dict, *targets: str, models: dict | None = None,
            quiet: bool = True) -> subprocess.CompletedProcess:
    config = dict(TINY, experiments={"paper": grid}, models={**TINY["models"], **(models or {})})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return dry_run_configs(tmp_path, [path], *targets, quiet=quiet)


def dry_run_configs(tmp_path: Path, configs: list[Path], *targets: str, quiet: bool = True) -> subprocess.CompletedProcess:
    return snakemake(tmp_path, configs, "-n", *(["--quiet", "rules"] if quiet else []), "--", *targets)


def job_inputs(result: subprocess.CompletedProcess, rule: str) -> list[str]:
    """The input files of the (one) job of `rule` in a dry run's job listing."""
    lines = result.stdout.splitlines()
    start = next(index for index, line in enumerate(lines) if line.strip() in (f"rule {rule}:", f"localrule {rule}:"))
    line = next(line for line in lines[start:] if line.strip().startswith("input:"))
    return [path.strip() for path in line.split("input:", 1)[1].split(",")]


def planned(result: subprocess.CompletedProcess) -> dict[str, int]:
    counts = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
            counts[parts[0]] = int(parts[1])
    return counts


def test_paper_target_plans_every_cell_once(tmp_path):
    grid = {"models": ["tiny"], "cells": [
        {"bpp": 2, "inits": ["greedy", "oaem"], "beams": [2, 4], "epochs": [2]},
        # seed 42 and geometry g8m2k64 are the defaults (config seed, tiny "2" = 2x6 bits over 8): no new runs
        {"bpp": 2, "inits": ["greedy", "oaem"], "beams": [2], "epochs": [2], "seeds": [42, 43, 44]},
        {"bpp": 2, "inits": ["oaem"], "beams": [2], "epochs": [2], "seeds": [42], "geometries": ["g8m2k64", "g4m1k256"]},
    ]}
    result = dry_run(tmp_path, grid, "paper")
    assert result.returncode == 0, result.stderr[-3000:]
    # greedy/oaem x b2/b4 (4), seeds 43/44 x 2 inits (4), the g4m1k256 geometry (1)
    assert planned(result)["stitch"] == 9 and planned(result)["paper"] == 1
    assert planned(result)["domain_distances"] == 1  # the one model's domain order and distance column


def test_a_second_model_in_the_grid_has_its_cells_and_its_own_domain_distances(tmp_path):
    """An entry with its own `models:` adds that model's cells as ordinary variant paths, and the
    tables read every grid model's domains.json (each under its own tokenizer), not the first's."""
    grid = {"models": ["tiny"], "cells": [
        {"bpp": 2, "inits": ["greedy", "oaem"], "beams": [2], "epochs": [2]},
        {"models": ["tiny-b"], "bpp": 2, "inits": ["greedy", "oaem"], "beams": [2], "epochs": [2], "seeds": [42, 43, 44]},
    ]}
    result = dry_run(tmp_path, grid, "paper", models={"tiny-b": {**TINY["models"]["tiny"], "tiny_hidden": 32}}, quiet=False)
    assert result.returncode == 0, result.stderr[-3000:]
    inputs = job_inputs(result, "paper")
    assert {"results/tiny/domains.json", "results/tiny-b/domains.json"} <= set(inputs)
    assert {f"results/tiny-b/2bpp/{init}/b2{seed}/eval.json" for init in ("greedy", "oaem")
            for seed in ("", "s43", "s44")} <= set(inputs)
    assert "results/tiny/2bpp/greedy/b2s43/eval.json" not in inputs  # seeds only where the entry names them


@pytest.mark.parametrize("profile", [[], ["profiles/gpu/gpu.yaml"]], ids=["config", "gpu-profile"])
def test_the_project_grid_plans_gemma_cells_as_variant_paths(tmp_path, profile):
    """config.yaml's paper grid (with and without the GPU profile's overrides): Gemma3-270M at 2 bpp
    b8, greedy and OA-EM, seeds 42-44, as ordinary variant paths, with its own domain distances."""
    result = dry_run_configs(tmp_path, [REPO / "config.yaml", *(REPO / path for path in profile)], "paper", quiet=False)
    assert result.returncode == 0, result.stderr[-3000:]
    inputs = job_inputs(result, "paper")
    gemma = sorted(path for path in inputs if path.startswith("results/gemma3-270m/"))
    assert gemma == sorted([f"results/gemma3-270m/2bpp/{init}/b8{seed}/eval.json" for init in ("greedy", "oaem")
                            for seed in ("", "s43", "s44")] + ["results/gemma3-270m/domains.json"])
    assert "results/smollm2/domains.json" in inputs


def test_cells_that_stop_before_pv_tuning_are_their_pre_pv_evaluations(tmp_path):
    """An entry with `pv: false`: its cells are the variants' eval_pre_pv.json, so the grid builds no
    PV-tuning for them, while the other entries' cells are PV-tuned as before."""
    grid = {"models": ["tiny"], "cells": [
        {"bpp": 2, "inits": ["greedy"], "beams": [2], "epochs": [2]},
        {"bpp": 2, "inits": ["oaem"], "beams": [2], "epochs": [2], "seeds": [42, 43], "pv": False},
    ]}
    result = dry_run(tmp_path, grid, "paper", quiet=False)
    assert result.returncode == 0, result.stderr[-3000:]
    inputs = job_inputs(result, "paper")
    assert {"results/tiny/2bpp/greedy/b2/eval.json", "results/tiny/2bpp/oaem/b2/eval_pre_pv.json",
            "results/tiny/2bpp/oaem/b2s43/eval_pre_pv.json"} <= set(inputs)
    assert not any(path.startswith("results/tiny/2bpp/oaem/") and path.endswith("/eval.json") for path in inputs)
    assert planned(result)["pvtune"] == 1 and planned(result)["stitch"] == 3


def assert_same_table(drawn: Path, published: Path) -> None:
    """Two CSV tables alike: the same header and rows, each cell the same text or, for numbers, equal to
    10^(1 - d) relative, d the significant digits CSV_FLOAT_FORMAT writes (a value whose last-bit
    difference between two CPUs falls on a rounding boundary is written one unit of the d-th digit apart)."""
    from aqflow.stages.paper_tables import CSV_FLOAT_FORMAT

    digits = int(CSV_FLOAT_FORMAT.strip("%.g"))
    rows = [list(csv.reader(path.read_text().splitlines())) for path in (drawn, published)]
    assert rows[0][0] == rows[1][0] and len(rows[0]) == len(rows[1]), published.name
    for line, (ours, theirs) in enumerate(zip(*rows)):
        assert len(ours) == len(theirs), (published.name, line)
        for a, b in zip(ours, theirs):
            if a != b:
                x, y = float(a), float(b)  # text that differs must be numbers
                assert abs(x - y) <= 10.0 ** (1 - digits) * max(abs(x), abs(y)), (published.name, line, a, b)


def test_the_published_tables_are_drawn_again_from_the_published_cells_alone(tmp_path):
    """profiles/published: `snakemake paper` reads config.yaml's grid from results/published (each
    cell's eval.json or eval_pre_pv.json, each model's domains.json), runs nothing else, and writes
    the same claims, cells and domains tables as results/published/paper holds (they are current),
    at the precision they are written with, whatever CPU draws them."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "published").symlink_to(REPO / "results" / "published")
    configs = [REPO / "config.yaml", REPO / "profiles" / "published" / "published.yaml"]
    result = snakemake(tmp_path, configs, "-c1", "paper")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 of 2 steps (100%) done" in result.stderr
    out, published = tmp_path / "results" / "paper", REPO / "results" / "published" / "paper"
    for table in ("claims.csv", "cells.csv", "domains.csv", "runs.csv"):
        assert_same_table(out / table, published / table)
    readme = (out / "README.md").read_text()
    assert "## Missing cells (0)\n\nnone" in readme  # every cell of the grid is published
    assert sorted(path.name for path in (tmp_path / "results").iterdir()) == ["paper", "published"]


def test_a_geometry_of_another_bit_rate_is_refused_when_the_dag_is_built(tmp_path):
    result = dry_run(tmp_path, {"models": ["tiny"], "cells": [{"bpp": 2, "inits": ["oaem"], "beams": [2]}]},
                     "results/tiny/2bpp/oaem/g8m1k256-b2/eval.json")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "g8m1k256-b2" in output and "stores 1 code bits per weight" in output


def test_results_folders_that_are_not_models_cannot_be_model_names(tmp_path):
    config = dict(TINY, models={**TINY["models"], "published": {"preset": "tiny"}})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, [path], "-n")
    assert result.returncode != 0 and "['published'] are folders of results/" in result.stdout + result.stderr


def test_the_grid_file_is_written_alone_before_any_cell_runs(tmp_path):
    import json

    grid = {"models": ["tiny"], "cells": [{"bpp": 2, "inits": ["greedy", "oaem"], "beams": [2], "epochs": [2],
                                           "seeds": [42, 43]}]}
    config = dict(TINY, experiments={"paper": grid})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, [path], "-c1", "results/paper/grid.json")
    assert result.returncode == 0, result.stderr[-3000:]
    cells = json.loads((tmp_path / "results" / "paper" / "grid.json").read_text())
    # epochs 2 and seed 42 are the tiny config's defaults: left out of the paths
    assert sorted(cell["eval_json"] for cell in cells) == sorted(
        f"results/tiny/2bpp/{init}/b2{seed}/eval.json" for init in ("greedy", "oaem") for seed in ("", "s43"))
    assert not (tmp_path / "resources").exists()  # nothing of the grid itself ran


@pytest.mark.slow
def test_domain_distances_of_a_model_are_one_job_on_its_own_text(tmp_path):
    """results/<model>/domains.json: the model, its calibration corpus and its evaluation corpora
    (fetched from the registry cache), and nothing of the quantization."""
    import json

    config = dict(TINY)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, [path], "-c1", "results/tiny/domains.json", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "tiny" / "domains.json").read_text())
    assert record["calibration"]["corpus"] == "c4-standin"
    assert sorted(row["domain"] for row in record["domains"]) == ["c4-standin", "wikitext2-standin"]
    # the calibration corpus's own held-out text is nearer to its calibration text than Wikipedia is
    assert [row["domain"] for row in record["domains"]] == ["c4-standin", "wikitext2-standin"]
    assert not (tmp_path / "results" / "tiny" / "2bpp").exists()


def test_published_grid_and_device_batches_are_the_config_grid(tmp_path):
    """results/published/paper/grid.json is what config.yaml's grid writes today, and the runs that
    ran it on the device machine (benchmarks/paper_runs.yaml) name only its cells: the one-card
    SmolLM2 run every SmolLM2 cell, the node run the ones it lists after the seeds done, both
    Gemma3-270M runs its every cell, Qwen's three runs its every cell."""
    import json

    result = snakemake(tmp_path, [REPO / "config.yaml"], "-c1", "results/paper/grid.json")
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "results" / "paper" / "grid.json").read_text())
    published = json.loads((REPO / "results" / "published" / "paper" / "grid.json").read_text())
    assert written == published
    cells = {cell["eval_json"] for cell in written}

    runs = yaml.safe_load((REPO / "benchmarks" / "paper_runs.yaml").read_text())["runs"]

    def targets(name):
        return [target for line in runs[name]["batches"] for target in line.split() if target != "all"]

    one_card, node, gemma, gemma_node, qwen = (targets(name)
                                               for name in ("smollm2", "smollm2_node", "gemma3", "gemma3_node", "qwen"))
    # Qwen's cells ran from its own batch file (all six before PV-tuning), the last one (two of
    # them PV-tuned) and the pair's (OA-EM seed 44 PV-tuned): together they name every Qwen cell,
    # and nothing but the grid's variants
    qwen_cells = {cell for cell in cells if cell.startswith("results/qwen2.5-coder-1.5b/")}
    qwen_targets = set(qwen) | set(targets("qwen_pair")) | {
        target for target in targets("last") if target.startswith("results/qwen")}
    assert qwen_cells <= qwen_targets
    assert {str(Path(target).parent) for target in qwen_targets} == {str(Path(cell).parent) for cell in qwen_cells}
    for batch in (one_card, node, gemma, gemma_node):
        assert len(batch) == len(set(batch)) and set(batch) <= cells
    assert sorted(gemma_node) == sorted(gemma)
    assert set(one_card) | {"results/smollm2/2bpp/greedy/b8/eval.json", "results/smollm2/2bpp/oaem/b8/eval.json"} == {
        cell for cell in cells if cell.startswith("results/smollm2/")}
    assert set(node) < set(one_card) and set(gemma) == {cell for cell in cells if cell.startswith("results/gemma3-270m/")}
    # the node's last cells: the batch file's lines are what the override's cell order ranks, each
    # cell once a line; the SmolLM2 cells, then twice Gemma's with every SmolLM2 cell again (a cell
    # that failed runs again)
    rest_lines = [line.split() for line in runs["rest_node"]["batches"]]
    order = runs["rest_node"]["overrides"]["execution"]["cell_order"]
    assert len(order) == len(set(order)) and set(order) <= cells and all(len(line) == len(set(line)) for line in rest_lines)
    assert len(rest_lines) == 3 and set(rest_lines[1]) == set(rest_lines[2]) == set(order) == set(rest_lines[0]) | set(gemma)
    assert set(node[-len(rest_lines[0]):]) == set(rest_lines[0])


def listed_jobs(result: subprocess.CompletedProcess) -> list[tuple[str, dict[str, str], int]]:
    """(rule, wildcards, priority) of every job of a dry run's listing (priority 0 where none is shown)."""
    jobs, rule = [], None
    for line in result.stdout.splitlines():
        stripped = line.strip()
        if stripped.startswith(("rule ", "localrule ", "checkpoint ")) and stripped.endswith(":"):
            rule, wildcards, priority = stripped.split()[-1].rstrip(":"), {}, 0
        elif rule and stripped.startswith("wildcards:"):
            wildcards = dict(item.split("=", 1) for item in stripped.split(":", 1)[1].strip().split(", "))
        elif rule and stripped.startswith("priority:"):
            priority = int(stripped.split(":", 1)[1])
        elif rule and stripped.startswith("resources:"):
            jobs.append((rule, wildcards, priority))
            rule = None
    return jobs


def test_cells_in_execution_cell_order_get_every_job_first_in_that_order(tmp_path):
    config = dict(TINY, execution={"cell_order": ["results/tiny/2bpp/oaem/b2e2/eval.json",
                                                  "results/tiny/2bpp/greedy/b2e2/eval.json"]})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cells = ["tiny/2bpp/oaem/b2e2", "tiny/2bpp/greedy/b2e2", "tiny/2bpp/greedy/b4e2"]
    result = dry_run_configs(tmp_path, [path], *(f"results/{cell}/eval.json" for cell in cells), quiet=False)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = listed_jobs(result)
    priorities = {(rule, "{model}/{bpp}bpp/{init}/{variant}".format(**wildcards)): priority
                  for rule, wildcards, priority in jobs if "variant" in wildcards}
    for rule in ("stitch", "evaluate_quantized", "pvtune", "evaluate_pvtuned"):
        assert [priorities[(rule, cell)] for cell in cells] == [2, 1, 0], rule
    # the model's shared jobs take its first listed cell's priority
    assert {(rule, wildcards["model"]): priority for rule, wildcards, priority in jobs
            if rule in ("fetch_model", "calibrate")} == {("fetch_model", "tiny"): 2, ("calibrate", "tiny"): 2}
