"""InputGuard's verdicts on a job's inputs (what common.smk makes Snakemake do with them)."""

from aqflow.io import artifacts
from aqflow.io.integrity import DigestCache
from aqflow.jobs.currency import InputGuard


def _run(tmp_path):
    """A stitched model folder and the evaluation made from it."""
    with artifacts.atomic_dir(tmp_path / "model") as staging:
        (staging / "model.safetensors").write_bytes(b"\1" * 4096)
        (staging / "config.json").write_text("{}")
    artifacts.write_json(tmp_path / "eval.json", {"ppl": 1.0})
    return tmp_path


def test_an_intact_input_passes_and_a_missing_one_is_rebuilt_only_under_an_existing_result(tmp_path):
    run = _run(tmp_path)
    guard = InputGuard(DigestCache(None))
    consumer = [str(run / "eval.json")]
    assert guard.check(str(run / "model"), consumer) is None
    # a killed job's outputs (Snakemake removes them) under a result made from the old ones
    verdict = guard.check(str(run / "pv_model"), consumer)
    assert verdict.rebuild == str(run / "pv_model") and "eval.json, which reads it, exists" in verdict.reason
    # the consumer does not exist either: Snakemake runs both anyway
    assert guard.check(str(run / "pv_model"), [str(run / "absent.json")]) is None
    # removed once used by design
    assert guard.check(str(run / "block1.inputs.safetensors"), consumer, temporary=True) is None


def test_a_folder_lacking_a_listed_file_is_rebuilt_and_a_corrupt_file_refused_with_advice(tmp_path):
    run = _run(tmp_path)
    guard = InputGuard(DigestCache(None))
    weights = run / "model" / "model.safetensors"
    weights.write_bytes(b"\2" * 4096)
    verdict = guard.check(str(run / "model"), [])
    assert verdict.rebuild is None and verdict.refusal.startswith(f"{weights}: corrupt: sha256 ")
    assert f"redo it: delete {weights} (or the folder {run / 'model'}) and rerun" in verdict.refusal
    weights.unlink()  # the advice, literally
    verdict = guard.check(str(run / "model"), [])
    assert verdict.rebuild == str(run / "model") and "model.safetensors is missing from the folder" in verdict.reason


def test_a_corrupt_single_file_names_itself_and_a_damaged_folder_record_names_the_folder(tmp_path):
    run = _run(tmp_path)
    guard = InputGuard(DigestCache(None))
    (run / "eval.json").write_text('{"ppl": 2.0}\n')
    verdict = guard.check(str(run / "eval.json"), [])
    assert verdict.refusal.endswith(f"redo it: delete {run / 'eval.json'} and rerun")
    (run / "model" / "SHA256SUMS").write_text("garbage\n")
    verdict = InputGuard(DigestCache(None)).check(str(run / "model"), [])
    assert verdict.refusal.endswith(f"redo it: delete the folder {run / 'model'} and rerun")


def test_a_damaged_resume_state_is_refused_with_the_advice_to_delete_it(tmp_path):
    guard = InputGuard(DigestCache(None))
    state = tmp_path / "state"
    assert guard.check_state(str(state), "PV-tuning") is None
    with artifacts.atomic_dir(state) as staging:
        (staging / "state.json").write_text('{"step": 3}')
    assert guard.check_state(str(state), "PV-tuning") is None
    (state / "state.json").write_text('{"step": 4}')
    verdict = InputGuard(DigestCache(None)).check_state(str(state), "PV-tuning")
    assert f"delete the folder {state} and rerun (PV-tuning then starts from the beginning)" in verdict.refusal


def test_a_damaged_part_of_a_state_saved_by_several_processes_is_refused(tmp_path):
    """PV-tuning saves one checksummed folder per step and process (step-N/rank-r): each is checked."""
    state = tmp_path / "state"
    for rank in range(2):
        with artifacts.atomic_dir(state / "step-0000002" / f"rank-{rank}") as staging:
            (staging / "state.json").write_text('{"step": 2}')
    assert InputGuard(DigestCache(None)).check_state(str(state), "PV-tuning") is None
    (state / "step-0000002" / "rank-1" / "state.json").write_text('{"step": 3}')
    verdict = InputGuard(DigestCache(None)).check_state(str(state), "PV-tuning")
    assert "rank-1" in verdict.refusal and f"delete the folder {state} and rerun" in verdict.refusal
