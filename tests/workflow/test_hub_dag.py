"""The headline path offline: a hub model and the hub's WikiText-2 and C4, served by a Hugging Face
cache that fixtures write, through the whole tiny DAG with HF_HUB_OFFLINE=1 (no network touched)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.hub_cache_datasets import C4_REPO, C4_TRAIN_FILE, C4_VALIDATION_FILE, WIKITEXT_REPO, write_hub_dataset_cache
from tests.hub_cache_models import write_hub_model

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "workflow" / "config.tiny.yaml"
VARIANT = "results/hubtiny/2bpp/oaem/b2e2"


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-dag")
    hf_home = root / "hf"
    hub_id, revision = write_hub_model(hf_home, "aqflow-tests/tiny-llama", "llama", dtype="bfloat16")
    write_hub_dataset_cache(hf_home)
    overrides = {
        "models": {"hubtiny": {"hub_id": hub_id}},  # no `text:` key: a hub model reads hub text
        "targets": [{"model": "hubtiny", "bpp": 2, "init": "oaem", "beam": 2, "epochs": 2}],
        "evaluation": {**yaml.safe_load(TINY.read_text())["evaluation"], "tasks": []},
    }
    config = root / "hub.yaml"
    config.write_text(yaml.safe_dump(overrides))
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))
    work = root / "work"
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2",
               "--configfile", str(TINY), str(config), "--directory", str(work)]
    plan = subprocess.run([*command, "-n", "--quiet", "rules"], capture_output=True, text=True, env=env, timeout=600)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3000)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return {"work": work, "hub_id": hub_id, "revision": revision, "plan": plan}


@pytest.mark.slow
def test_the_plan_reads_only_hub_text(hub_run):
    plan = hub_run["plan"]
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "fetch_data" in plan.stdout
    work = hub_run["work"]
    corpora = sorted(path.name for path in (work / "resources" / "data").glob("*.parquet"))
    assert corpora == ["c4.parquet", "wikitext2.parquet"]  # no stand-in was fetched


@pytest.mark.slow
def test_hub_model_and_hub_text_through_the_whole_dag(hub_run):
    work, hub_id, revision = hub_run["work"], hub_run["hub_id"], hub_run["revision"]
    marker = json.loads((work / "resources/models/hubtiny/aqflow_model.json").read_text())
    assert marker["hub_id"] == hub_id and marker["commit"] == revision
    c4_split = json.loads((work / "resources/data/c4.split.json").read_text())
    assert {f["repo_id"] for f in c4_split["origin"]["files"]} == {C4_REPO}
    calibrations = [path.name for path in (work / "results/hubtiny/calib").iterdir()]
    assert len(calibrations) == 1 and calibrations[0].startswith("c4-")  # calibrated on the hub's C4

    record = json.loads((work / VARIANT / "eval.json").read_text())
    for stage in (record, record["pre_pv"]):  # after and before PV-tuning
        assert {"wikitext2", "c4"} <= set(stage["metrics"]) and not any("standin" in key for key in stage["metrics"])
        assert stage["data"]["wikitext2"]["text"]["kind"] == "hub"
        assert {f["repo_id"] for f in stage["data"]["wikitext2"]["text"]["files"]} == {WIKITEXT_REPO}
        roles = {f["filename"]: f["role"] for f in stage["data"]["c4"]["text"]["files"]}
        assert roles == {C4_TRAIN_FILE: "calibration", C4_VALIDATION_FILE: "evaluation"}
    assert record["settings"]["upstream"]["pvtune"]["data"]["corpus"].endswith("c4.parquet")

    summary = pd.read_csv(work / "results/report/summary.csv")
    quantized = summary[summary["init"] == "oaem"].iloc[0]
    assert quantized["calibration_corpus"] == "c4"
    assert "wikitext2=hub Salesforce/wikitext@" in quantized["eval_text"] and "c4=hub allenai/c4@" in quantized["eval_text"]
    assert quantized["wikitext2_ppl"] > 1 and quantized["pre_pv_wikitext2_ppl"] > 1
    assert "wikitext2-standin_ppl" not in summary or summary["wikitext2-standin_ppl"].isna().all()
