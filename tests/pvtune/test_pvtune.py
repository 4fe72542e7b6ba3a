"""PV-tuning on a tiny random Llama, on CPU: it lowers the held-out loss, the V-step moves codes
within its budget, the P-step never touches them, the selected state is the best held-out one,
and the written checkpoint reloads in transformers + aqlm and evaluates."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from aqflow import checkpoint
from aqflow.data.offline_text import CALIBRATION, load_split_corpus, split_documents, write_split_corpus
from aqflow.models import build_tiny_llama, load_causal_lm, load_tokenizer
from aqflow.stages.quantize_layer import quantize_every_linear
from aqflow.pvtune import train as pvtrain
from aqflow.pvtune.data import pv_windows
from aqflow.pvtune.loss import chunked_kl_sum, output_logits
from aqflow.pvtune.student import PVLinear, load_student, pv_linears
from aqflow.pvtune.vstep import group_squared_errors, groups_to_update, reencode_groups, v_step_layer
from aqflow.quant.representation import dequantize_weight
from aqflow.stagekit.stage_cli import run_stage_module
from aqflow.stages import evaluate, pvtune

NBITS, NUM_CODEBOOKS = 6, 2
WORDS = ("the quick brown fox jumps over lazy dog additive quantization codebook group weight model token "
         "calibration evaluation split document beam search").split()
QUICK = dict(batch_size=8, micro_batch_size=4, eval_every_steps=2, kl_chunk_tokens=50, lr=1e-4, code_lr=1e-3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama, its stitched 2x6-bit AQLM checkpoint (every linear quantized by the
    quantize-layer stage) and a split corpus of 24 synthetic documents."""
    root = tmp_path_factory.mktemp("pv")
    model_dir = build_tiny_llama(root / "fp", hidden_size=64, intermediate_size=128, seed=0)
    layers = root / "layers"
    quantize_every_linear(model_dir, layers, NBITS, NUM_CODEBOOKS)
    aqlm_dir = checkpoint.write_aqlm_checkpoint(model_dir, layers, root / "aqlm", num_codebooks=NUM_CODEBOOKS,
                                                nbits=NBITS, dtype="float32")
    rng = np.random.default_rng(0)
    docs = pd.DataFrame({"doc_id": [f"doc{i:02d}" for i in range(24)],
                         "text": [" ".join(rng.choice(WORDS, 300)) for _ in range(24)], "source": "synthetic"})
    corpus = root / "corpus.parquet"
    write_split_corpus(split_documents(docs, 0.5, 0), corpus, 0, 0.5)
    data = pv_windows(corpus, load_tokenizer(model_dir), num_samples=16, heldout_samples=8, window_tokens=48,
                      heldout_fraction=0.25, seed=0)
    return {"root": root, "model_dir": model_dir, "aqlm_dir": aqlm_dir, "corpus": corpus, "data": data, "layers": layers}


def _teacher(setup):
    teacher = load_causal_lm(setup["model_dir"])
    teacher.requires_grad_(False)
    return teacher


def _fresh_run(setup, **settings):
    """A fresh student and teacher PV-tuned on the setup's windows with QUICK's settings updated by
    `settings` -> (the loop's result, the trained student)."""
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    result = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                           pvtrain.PVSettings(**(QUICK | settings)), "cpu", progress=False)
    return result, student


def _codes(student) -> dict[str, torch.Tensor]:
    return {name: layer.codes.clone() for name, layer in pv_linears(student).items()}


# --- pieces ------------------------------------------------------------------------------------

def test_student_is_the_stitched_model(setup):
    student = load_student(setup["aqlm_dir"])
    reference = checkpoint.dequantized_model(setup["model_dir"], setup["layers"])
    input_ids = setup["data"].heldout.input_ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids).logits, reference(input_ids).logits, rtol=1e-4, atol=1e-4)
    assert len(pv_linears(student)) == 14


def test_straight_through_weight_gets_the_weight_gradient_and_changes_no_output(rng):
    codebooks = torch.randn(2, 16, 8, generator=rng)
    codes = torch.randint(0, 16, (5, 3, 2), generator=rng)
    scales, bias = torch.rand(5, generator=rng) + 0.5, torch.randn(5, generator=rng)
    layer = PVLinear(codes, codebooks, scales, bias)
    layer.enable_straight_through()
    with torch.no_grad():
        layer.straight_through.add_(1.0)  # the float copy may drift: the output must not follow it
    x = torch.randn(7, 24, generator=rng)
    weight = dequantize_weight(codes, codebooks, scales).requires_grad_(True)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(layer(x), expected)
    layer(x).square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(layer.straight_through.grad, weight.grad)
    assert layer.codebooks.grad is not None and layer.scales.grad is not None


def test_weight_gradients_summed_per_step_equal_autograd_through_every_call(setup):
    """Two micro-batches with activation checkpointing: the open/close path (dL/dW summed, then
    pushed through the dequantization once) gives the gradients of plain autograd through every
    call's dequantization, for straight-through weights, codebooks, scales and the rest."""
    from aqflow.pvtune.student import close_weight_gradients, open_weight_gradients

    settings = pvtrain.PVSettings(**QUICK)
    windows = setup["data"].train.input_ids[:4]
    teacher = _teacher(setup)
    gradients = []
    for summed in (False, True):
        student = load_student(setup["aqlm_dir"])
        layers = list(pv_linears(student).values())
        trainable = pvtrain.trainable_groups(student, settings)
        p_params, v_params = trainable.non_quantized + trainable.quantized, trainable.straight_through
        pvtrain.set_checkpointing(student, True)
        student.train()
        if summed:
            open_weight_gradients(layers)
            assert all(layer.weight_gradient is layer.straight_through.grad for layer in layers)
        for micro in (windows[:2], windows[2:]):
            pvtrain.micro_batch_kl(student, teacher, micro, settings, torch.device("cpu")).backward()
        if summed:
            close_weight_gradients(layers)
            assert all(layer.weight_gradient is None for layer in layers)
        names = {id(p): n for n, p in student.named_parameters()}
        gradients.append({names[id(p)]: p.grad.clone() for p in p_params + v_params})
    plain, summed = gradients
    assert plain.keys() == summed.keys() and any(name.endswith("straight_through") for name in plain)
    for name in plain:
        torch.testing.assert_close(summed[name], plain[name], rtol=1e-4, atol=1e-7, msg=name)
        assert plain[name].abs().sum() > 0, name


def test_chunked_kl_equals_the_full_kl_and_its_gradient(setup):
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    hidden_s = torch.randn(37, 64, requires_grad=True)
    hidden_t = torch.randn(37, 64)
    chunked = chunked_kl_sum(student, teacher, hidden_s, hidden_t, chunk_tokens=10)
    (grad_chunked,) = torch.autograd.grad(chunked, hidden_s)
    log_q = F.log_softmax(output_logits(student, hidden_s), -1)
    log_p = F.log_softmax(output_logits(teacher, hidden_t), -1)
    full = (log_p.exp() * (log_p - log_q)).sum()
    (grad_full,) = torch.autograd.grad(full, hidden_s)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_chunked, grad_full, rtol=1e-4, atol=1e-7)


def test_pv_data_comes_from_disjoint_calibration_documents(setup):
    frame = load_split_corpus(setup["corpus"])
    calibration = set(frame.loc[frame["role"] == CALIBRATION, "doc_id"])
    train_docs, heldout_docs = set(setup["data"].train.doc_ids), set(setup["data"].heldout.doc_ids)
    assert train_docs <= calibration and heldout_docs <= calibration
    assert not train_docs & heldout_docs
    assert set(setup["data"].record["heldout_doc_ids"]) >= heldout_docs


def test_groups_to_update_takes_the_largest_errors_within_the_fraction():
    errors = torch.tensor([[0.0, 5.0, 1.0, 3.0], [2.0, 0.5, 4.0, 0.0]])  # 8 groups
    assert groups_to_update(errors, 0.25).tolist() == [1, 6]  # ceil(0.25 * 8) = 2 largest
    assert groups_to_update(errors, 0.3).tolist() == [1, 6, 3]  # ceil(2.4) = 3
    assert sorted(groups_to_update(errors, 1.0).tolist()) == [1, 2, 3, 4, 5, 6]  # zero-error groups never


def test_reencoding_moves_only_chosen_groups_and_never_away_from_the_target(rng):
    codebooks = torch.randn(2, 16, 8, generator=rng)
    codes = torch.randint(0, 16, (6, 4, 2), generator=rng)
    scales = torch.rand(6, generator=rng) + 0.5
    current = dequantize_weight(codes, codebooks, scales)
    target = current + 0.8 * torch.randn(current.shape, generator=rng)
    errors = group_squared_errors(target, current, 8)
    chosen = groups_to_update(errors, 0.25)
    new_codes = reencode_groups(target, codes, codebooks, scales, chosen, beam_size=4)
    new_errors = group_squared_errors(target, dequantize_weight(new_codes, codebooks, scales), 8)
    changed = (new_codes != codes).any(-1).reshape(-1)
    assert changed.any() and set(changed.nonzero().flatten().tolist()) <= set(chosen.tolist())
    assert (new_errors.reshape(-1) <= errors.reshape(-1) + 1e-6).all()
    assert new_errors.sum() < errors.sum()


def test_v_step_changes_at_most_the_configured_fraction_of_each_layer(setup, rng):
    layer = next(iter(pv_linears(load_student(setup["aqlm_dir"])).values()))
    layer.enable_straight_through()
    before = layer.codes.clone()
    with torch.no_grad():
        layer.straight_through.add_(0.05 * torch.randn(layer.straight_through.shape, generator=rng))
    num_groups = before.shape[0] * before.shape[1]
    changed = v_step_layer(layer, max_fraction=0.05, beam_size=2)
    assert 0 < changed <= math.ceil(0.05 * num_groups)
    assert changed == int((layer.codes != before).any(-1).sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_v_step_replayed_as_a_cuda_graph_equals_the_eager_v_step(setup, rng):
    """Three V-steps with the straight-through weights moved in place between them: the recorded
    and replayed graph leaves the same codes, step by step, as running every layer eagerly."""
    from aqflow.pvtune.vstep import VStep

    students = [load_student(setup["aqlm_dir"], "cuda") for _ in range(2)]
    runners = []
    for student, use_graph in zip(students, (False, True)):
        layers = list(pv_linears(student).values())
        for layer in layers:
            layer.enable_straight_through()
        runners.append((layers, VStep(layers, 0.05, 1, use_graph=use_graph)))
    assert runners[1][1].use_graph and not runners[0][1].use_graph
    for _ in range(3):
        noise = [0.05 * torch.randn(layer.straight_through.shape, generator=rng) for layer in runners[0][0]]
        counts = []
        for layers, v_step in runners:
            with torch.no_grad():
                for layer, delta in zip(layers, noise):
                    layer.straight_through.add_(delta.cuda())
            counts.append(v_step())
        assert counts[0] == counts[1] > 0
        for eager, replayed in zip(runners[0][0], runners[1][0]):
            assert torch.equal(eager.codes, replayed.codes)


# --- training ----------------------------------------------------------------------------------

def test_p_step_alone_never_touches_codes(setup):
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    codes = _codes(student)
    codebooks = {name: layer.codebooks.detach().clone() for name, layer in pv_linears(student).items()}
    settings = pvtrain.PVSettings(epochs=1, update_codes=False, **QUICK)
    result = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids, settings,
                           "cpu", progress=False)
    assert result.steps == 2
    for name, layer in pv_linears(student).items():
        assert torch.equal(layer.codes, codes[name]) and layer.straight_through is None
    assert all(row["codes_changed_fraction"] == 0 for row in result.log if row["split"] == "train")
    moved = [not torch.equal(layer.codebooks.detach(), codebooks[name]) for name, layer in pv_linears(student).items()]
    assert result.best_step == 0 or all(moved)


def test_selected_state_is_the_best_heldout_one(setup):
    """A large learning rate makes the later states worse than some earlier one; whatever
    happens, the student ends in the state of the logged held-out minimum."""
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    settings = pvtrain.PVSettings(epochs=3, **(QUICK | dict(lr=3e-2, code_lr=3e-2, eval_every_steps=1)))
    heldout = setup["data"].heldout.input_ids
    result = pvtrain.train(student, teacher, setup["data"].train.input_ids, heldout, settings, "cpu", progress=False)
    evals = [row for row in result.log if row["split"] == "heldout"]
    assert len(evals) == result.steps + 1 == 7
    best = min(evals, key=lambda row: row["kl"])
    assert result.best_step == best["step"]
    final = pvtrain.heldout_metrics(student, teacher, heldout, settings, torch.device("cpu"))
    assert final["kl"] == pytest.approx(best["kl"], rel=1e-5)


def test_stage_lowers_heldout_loss_changes_codes_and_writes_a_loadable_checkpoint(setup):
    root = setup["root"]
    out, log_path, metrics_path = root / "pv-model", root / "train_log.parquet", root / "pvtune.json"
    max_fraction = 0.02
    settings = pvtune.PvtuneSettings(
        num_samples=16, heldout_samples=8, window_tokens=48, heldout_fraction=0.25, device="cpu", quiet=True,
        training=pvtrain.PVSettings(epochs=3, batch_size=8, micro_batch_size=4, eval_every_steps=2, lr=1e-4,
                                    max_code_change_fraction=max_fraction))
    paths = pvtune.PvtunePaths(model_dir=setup["model_dir"], checkpoint_dir=setup["aqlm_dir"], corpus=setup["corpus"],
                               output_dir=out, train_log=log_path, metrics=metrics_path)
    assert run_stage_module(pvtune, settings, paths) == 0
    metrics = json.loads(metrics_path.read_text())
    log = pd.read_parquet(log_path)
    assert metrics["best_heldout_kl"] < metrics["initial_heldout_kl"]
    heldout = log[log["split"] == "heldout"]
    assert heldout["selected"].sum() == 1
    assert heldout.loc[heldout["selected"], "kl"].item() == heldout["kl"].min() == metrics["best_heldout_kl"]
    # V-step: codes move, never more than ceil(fraction * groups) per layer and step
    student = load_student(setup["aqlm_dir"])
    groups = [layer.codes.shape[0] * layer.codes.shape[1] for layer in pv_linears(student).values()]
    budget = sum(math.ceil(max_fraction * n) for n in groups) / sum(groups)
    train_rows = log[log["split"] == "train"]
    assert (train_rows["codes_changed_fraction"] > 0).any()
    assert (train_rows["codes_changed_fraction"] <= budget + 1e-12).all()
    tuned = load_student(out)
    assert any(not torch.equal(a.codes, b.codes) for a, b in zip(pv_linears(tuned).values(), pv_linears(student).values()))
    assert metrics["codes_changed_fraction"] > 0
    # the output is a standard AQLM checkpoint: transformers + aqlm load it, and it scores the
    # held-out KL that was selected
    reloaded = evaluate.load_model(out, "float32", "cpu", "aqlm")
    assert any(type(m).__name__ == "QuantizedLinear" for m in reloaded.modules())
    settings = pvtrain.PVSettings(**QUICK)
    again = pvtrain.heldout_metrics(reloaded, _teacher(setup), setup["data"].heldout.input_ids, settings, torch.device("cpu"))
    assert again["kl"] == pytest.approx(metrics["best_heldout_kl"], rel=1e-3)
    eval_path = root / "eval.json"
    corpus = str(setup["corpus"])
    assert run_stage_module(evaluate, evaluate.EvaluateSettings(perplexity=("wikitext2",), context=48, max_windows=4,
                                                                tasks=(), device="cpu", quiet=True),
                            evaluate.EvaluatePaths(model_dir=out, output=eval_path, wikitext2_corpus=Path(corpus),
                                                   c4_corpus=Path(corpus))) == 0
    record = json.loads(eval_path.read_text())
    assert math.isfinite(record["metrics"]["wikitext2"]["perplexity"])
    assert record["storage"]["format"] == "aqlm"


def test_stage_refuses_a_plain_model_as_student(setup, capsys):
    root = setup["root"]
    code = pvtune.main(["--model-dir", str(setup["model_dir"]), "--checkpoint-dir", str(setup["model_dir"]),
                        "--corpus", str(setup["corpus"]), "--output-dir", str(root / "x"), "--train-log", str(root / "x.parquet"),
                        "--metrics", str(root / "x.json"), "--num-samples", "4", "--heldout-samples", "2",
                        "--window-tokens", "48", "--device", "cpu", "--quiet"])
    assert code == 2 and "not an AQLM checkpoint" in capsys.readouterr().err
    assert not (root / "x").exists()


# --- torch.distributed ---------------------------------------------------------------------------

TEN_STEPS = dict(epochs=5, **(QUICK | dict(micro_batch_size=2, eval_every_steps=1, code_lr=3e-2)))  # 16 windows, 8 a step


def _float64_models(setup):
    """Student and teacher in float64: one process and two then differ by float summation order
    alone (~1e-12), which Adam's normalised steps would amplify to ~1e-5 in float32."""
    return load_student(setup["aqlm_dir"]).double(), _teacher(setup).double()


def _distributed_worker(rank: int, world_size: int, init_file: str, setup: dict, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        student, teacher = _float64_models(setup)
        result = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                               pvtrain.PVSettings(**TEN_STEPS), "cpu", progress=False)
        state = {name: tensor.contiguous() for name, tensor in result.student_state.items()
                 if not name.endswith("straight_through")}  # each process's own rows
        save_file(state, os.path.join(out_dir, f"rank{rank}.safetensors"))
        record = {"heldout": [row["kl"] for row in result.log if row["split"] == "heldout"],
                  "state_bytes": result.state_bytes, "steps": result.steps}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def test_two_processes_shard_the_state_and_train_like_one(setup, tmp_path):
    """Two gloo processes (FSDP2 and the V-step's rows sharded, each half of every batch) over 10
    steps: the held-out KL of one process at every step (relative 1e-5), identical codes on both
    and equal to one process's, the same weights up to float summation order, and each process
    holding at most 0.6 of the state one process holds."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    setup_plain = {key: setup[key] for key in ("aqlm_dir", "model_dir", "data")}
    mp.start_processes(_distributed_worker, args=(2, str(tmp_path / "init"), setup_plain, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    student, teacher = _float64_models(setup)
    single = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                           pvtrain.PVSettings(**TEN_STEPS), "cpu", progress=False)
    assert single.steps == records[0]["steps"] == 10
    curve = [row["kl"] for row in single.log if row["split"] == "heldout"]
    assert len(curve) == 11 and curve[-1] < curve[0]
    for record in records:
        assert record["heldout"] == pytest.approx(curve, rel=1e-5)
        assert record["state_bytes"] <= 0.6 * single.state_bytes, (record["state_bytes"], single.state_bytes)
    state = {name: tensor for name, tensor in student.state_dict().items() if not name.endswith("straight_through")}
    assert ranks[0].keys() == state.keys()
    start = load_student(setup["aqlm_dir"]).state_dict()
    changed = 0
    for name in state:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        if name.endswith(".codes"):
            assert torch.equal(ranks[0][name], state[name]), name
            changed += int((state[name] != start[name]).sum())
        else:
            torch.testing.assert_close(ranks[0][name], state[name], rtol=1e-6, atol=1e-9)
    assert changed > 0  # the V-step moved codes, alike on every process


def test_every_config_setting_reaches_the_stage_as_written():
    """config.yaml's pvtune keys (as the rule passes them, through the one mapping of
    aqflow.jobs.workflow_glue) are exactly fields of the stage's settings, and keys left out of the
    config fall back to the same values (the paper's)."""
    from pathlib import Path
    from types import SimpleNamespace

    import yaml

    from aqflow.jobs import workflow_glue
    from aqflow.jobs.plan import Execution
    from aqflow.stagekit.stage_cli import from_dict

    section = yaml.safe_load((Path(__file__).resolve().parents[2] / "config.yaml").read_text())["pvtune"]
    settings = {key: value for key, value in section.items() if key not in ("enabled", "corpus")}
    execution = Execution(warm_workers=False, warm_worker_idle_seconds=20, logits_budget_gib=16, cell_order=(),
                          save_state_every=pvtune.PvtuneSettings().save_state_every)
    job = SimpleNamespace(params=SimpleNamespace(settings=settings, execution=execution),
                          input=SimpleNamespace(model="m", checkpoint="c", corpus="c.parquet"),
                          output=SimpleNamespace(model="o", train_log="t.parquet", metrics="p.json"),
                          resources=SimpleNamespace(gpu=1))
    shaped = workflow_glue.pvtune(job).settings
    parsed, defaults = from_dict(pvtune.PvtuneSettings, shaped), pvtune.PvtuneSettings()

    def value_of(built, key):
        return getattr(built.training, key) if hasattr(built.training, key) else getattr(built, key)

    for key, value in settings.items():
        assert value_of(parsed, key) == value, key
        assert value_of(defaults, key) == value, key


def test_torchrun_runs_the_stage_on_two_processes(setup, tmp_path):
    """`torchrun -m aqflow pvtune` on CPU (gloo): one set of outputs, written by process 0, with
    the held-out numbers of the single-process run of the same settings."""
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    common = ["--model-dir", str(setup["model_dir"]), "--checkpoint-dir", str(setup["aqlm_dir"]),
              "--corpus", str(setup["corpus"]), "--num-samples", "16", "--heldout-samples", "8", "--window-tokens", "48",
              "--heldout-fraction", "0.25", "--epochs", "1", "--batch-size", "8", "--micro-batch-size", "2",
              "--eval-every-steps", "1", "--no-update-codes", "--device", "cpu", "--quiet"]

    def outputs(name):
        return ["--output-dir", str(tmp_path / name), "--train-log", str(tmp_path / f"{name}.parquet"),
                "--metrics", str(tmp_path / f"{name}.json")]

    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "aqflow", "pvtune",
                             *common, *outputs("two")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("wall time:") == 1
    assert pvtune.main([*common, *outputs("one")]) == 0
    two, one = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("two", "one"))
    assert two["settings"]["world_size"] == 2 and one["settings"]["world_size"] == 1
    assert two["best_heldout_kl"] == pytest.approx(one["best_heldout_kl"], rel=1e-4)
    assert (tmp_path / "two" / "config.json").is_file()


def test_v_step_with_weight_rms_moves_every_layer_by_the_same_fraction_of_its_size():
    """Adam's first step is about lr whatever the gradient's size: in weight units it is a 10x larger
    move, relative to the weights, for a layer 10x smaller; in units of the layer's RMS it is not."""
    from aqflow.pvtune.train import v_step_param_groups

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(16, 32, generator=generator)
    gradient = torch.randn(16, 32, generator=generator)

    def relative_move(scale: float, unit: str) -> float:
        weight = torch.nn.Parameter(base * scale)
        optimizer = torch.optim.Adam(v_step_param_groups([weight], 0.01, unit), betas=(0.0, 0.95))
        weight.grad = gradient * scale  # any size: Adam normalises it
        optimizer.step()
        return float((weight.detach() - base * scale).norm() / (base * scale).norm())

    assert relative_move(0.1, "absolute") == pytest.approx(10 * relative_move(1.0, "absolute"), rel=1e-4)
    assert relative_move(0.1, "weight_rms") == pytest.approx(relative_move(1.0, "weight_rms"), rel=1e-4)
    groups = v_step_param_groups([torch.nn.Parameter(base), torch.nn.Parameter(2 * base)], 0.01, "weight_rms")
    assert [group["lr"] for group in groups] == pytest.approx([0.01 * float(base.square().mean().sqrt()) * k for k in (1, 2)])
    assert [group["lr"] for group in v_step_param_groups([torch.nn.Parameter(base)] * 3, 0.01, "absolute")] == [0.01] * 3
    # over several processes each holds some rows: the unit is the whole layer's RMS, given
    rows = v_step_param_groups([torch.nn.Parameter(base[:4])], 0.01, "weight_rms", rms=[2.5])
    assert rows[0]["lr"] == pytest.approx(0.025)
    with pytest.raises(ValueError, match="code_lr_scale"):
        v_step_param_groups([torch.nn.Parameter(base)], 0.01, "relative")


def test_a_step_that_runs_out_of_memory_is_redone_with_smaller_micro_batches(setup, monkeypatch, capsys):
    """Where the second forward pass of 4 windows runs out of memory (the first one's gradient is
    already summed), the step is redone at 2 windows per pass and training ends where a run at 2
    from the start does: the half-summed gradient was dropped."""
    settings = pvtrain.PVSettings(epochs=1, **QUICK)  # micro-batch 4, batch 8

    def run(micro_batch_size: int, fail_above: int | None):
        student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
        real = pvtrain.micro_batch_kl
        calls = []

        def tight_memory(student, teacher, input_ids, settings, device):
            calls.append(input_ids.shape[0])
            if fail_above is not None and input_ids.shape[0] > fail_above and len(calls) > 1:
                raise torch.OutOfMemoryError("simulated: the card is full")
            return real(student, teacher, input_ids, settings, device)

        monkeypatch.setattr(pvtrain, "micro_batch_kl", tight_memory)
        result = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                               replace(settings, micro_batch_size=micro_batch_size), "cpu", progress=False)
        return result, pvtrain.snapshot(student, list(student.parameters())), calls

    redone, redone_state, calls = run(4, fail_above=2)
    plain, plain_state, _ = run(2, fail_above=None)
    assert calls[:3] == [4, 4, 2] and redone.micro_batch_size == 2 and "redone with 2 windows" in capsys.readouterr().err
    assert [row["kl"] for row in redone.log] == pytest.approx([row["kl"] for row in plain.log], rel=1e-6)
    for name, value in plain_state.items():
        torch.testing.assert_close(redone_state[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_out_of_memory_at_one_window_is_not_retried(setup, monkeypatch):
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)

    def full(*args):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(pvtrain, "micro_batch_kl", full)
    with pytest.raises(torch.OutOfMemoryError):
        pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                      pvtrain.PVSettings(epochs=1, **(QUICK | dict(micro_batch_size=1))), "cpu", progress=False)


def test_micro_batch_probe_arithmetic():
    """The probe's budget: what is left after gradients, moments and the search budget, less 10 %,
    in whole windows, capped; 0 (and a warning naming the sizes) where one window does not fit."""
    gib = 2**30
    assert pvtrain.windows_that_fit(100 * gib, 20 * gib, 30 * gib, 1 * gib, 4 * gib, most=32) == 11  # 0.9 x 49 = 44.1 GiB, over 4
    assert pvtrain.windows_that_fit(100 * gib, 20 * gib, 30 * gib, 1 * gib, 1 * gib, most=32) == 32
    assert pvtrain.windows_that_fit(50 * gib, 20 * gib, 30 * gib, 1 * gib, 1 * gib, most=32) == 0
    warning = pvtrain.memory_warning(50 * gib, 20 * gib, 30 * gib, 3 * gib, 4096)
    assert "20.0 GiB" in warning and "30.0 GiB" in warning and "4096 tokens needs 3.0 GiB" in warning


@pytest.mark.parametrize("code_beta1", [0.0, 0.9])
def test_state_bytes_from_headers_equal_what_training_holds(setup, code_beta1):
    """The header arithmetic of pvtune.memory against the loaded teacher and student: teacher
    weights, codes, and (after one step) every straight-through copy, its gradient buffer and the
    V-step optimiser's moments."""
    from aqflow.models.folder import tensor_headers
    from aqflow.pvtune.memory import PVMemoryError, require_fit, state_bytes

    settings = pvtrain.PVSettings(epochs=1, code_beta1=code_beta1, **QUICK)
    parts = state_bytes(tensor_headers(setup["aqlm_dir"]), tensor_headers(setup["model_dir"]), 4, settings)
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    layers = pv_linears(student).values()
    assert parts["teacher"] == sum(p.nbytes for p in teacher.parameters())
    assert parts["codes"] == sum(layer.codes.nbytes for layer in layers)
    v_params = pvtrain.trainable_groups(student, settings).straight_through
    optimizer = pvtrain.v_step_optimizer(pvtrain.v_step_param_groups(v_params, 1e-3, "absolute"), code_beta1, 0.95)
    for weight in v_params:
        weight.grad = torch.ones_like(weight)
    optimizer.step()
    moments = sum(t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim() > 0)
    assert parts["v_step"] == sum(2 * w.nbytes for w in v_params) + moments
    quantized = {id(t) for layer in layers for t in (layer.codebooks, layer.scales, layer.straight_through)}
    rest = sum(p.nbytes for p in student.parameters() if id(p) not in quantized)
    assert parts["non_quantized"] == 4 * rest  # with gradient and two moments
    require_fit(parts, sum(parts.values()), "cuda:0")
    with pytest.raises(PVMemoryError, match=r"needs .* GiB on cuda:0 .*teacher"):
        require_fit(parts, sum(parts.values()) - 1, "cuda:0")


def test_the_wait_for_a_full_card_ends_when_its_memory_is_free_or_at_the_timeout():
    """A fake card whose other jobs free 10 GiB a poll: the wait ends at the first poll that sees
    the state's bytes free; a card that never frees them is waited for exactly the timeout."""
    from aqflow.pvtune.memory import wait_for_free_memory

    gib = 2**30
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    def clock():
        return now[0]

    freed = iter(range(0, 1000 * gib, 10 * gib))
    free, waited = wait_for_free_memory(26 * gib, lambda: next(freed), timeout_seconds=300, poll_seconds=5,
                                        sleep=sleep, clock=clock)
    assert free == 30 * gib and waited == 15.0  # polls at 0, 5, 10, 15 s saw 0, 10, 20, 30 GiB
    now[0] = 0.0
    free, waited = wait_for_free_memory(26 * gib, lambda: gib, timeout_seconds=12, poll_seconds=5, sleep=sleep, clock=clock)
    assert free == gib and waited == 12.0  # the last sleep is cut to the timeout, never past it
    assert wait_for_free_memory(gib, lambda: 2 * gib, timeout_seconds=300, sleep=sleep, clock=clock)[0] == 2 * gib


# --- host-resident V-step state, early stop ----------------------------------------------------

def test_the_v_step_state_in_host_memory_takes_the_same_steps_as_on_the_device(setup):
    """v_state host (straight-through weights and moments streamed through the device once a step,
    `aqflow.pvtune.offload`) against the state kept beside the model: the same held-out curve,
    codes and weights (on a CPU the stream is a copy to the same memory; the arithmetic is the same)."""
    runs = []
    for v_state in ("device", "host"):
        result, student = _fresh_run(setup, epochs=2, v_state=v_state, lr=3e-2, code_lr=3e-2, eval_every_steps=2)
        runs.append((result, {k: v for k, v in student.state_dict().items() if not k.endswith("straight_through")}))
    (device, device_state), (host, host_state) = runs
    assert [row["kl"] for row in host.log] == [row["kl"] for row in device.log]
    assert any(row["codes_changed_fraction"] > 0 for row in host.log if row["split"] == "train")
    for name, value in device_state.items():
        assert torch.equal(host_state[name], value), name


def test_out_of_memory_halves_the_micro_batch_then_recomputes_activations_then_gives_up(setup, monkeypatch):
    """A step that runs out of memory is redone with half the windows per pass, at one window with
    activations recomputed (switched on in the model), and only then is the error raised."""
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    layers = list(pv_linears(student).values())
    windows = setup["data"].train.input_ids[:4]
    tried = []

    def failing(student_, teacher_, train_windows, batch, settings, *rest):
        recomputing = getattr(student, "is_activation_checkpointing", None)  # transformers >= 5.x's name
        recomputing = student.is_gradient_checkpointing if recomputing is None else recomputing
        tried.append((settings.micro_batch_size, settings.gradient_checkpointing, recomputing))
        if len(tried) < 4:
            raise torch.OutOfMemoryError("probe")
        return torch.zeros((), dtype=torch.float64)

    monkeypatch.setattr(pvtrain, "batch_gradients", failing)
    pvtrain.set_checkpointing(student, False)
    settings = pvtrain.PVSettings(**(QUICK | dict(micro_batch_size=4, gradient_checkpointing="never")))
    _, used = pvtrain.gradients_within_memory(student, teacher, windows, torch.arange(4), settings, torch.device("cpu"),
                                              layers, [], 1)
    assert tried == [(4, "never", False), (2, "never", False), (1, "never", False), (1, "always", True)]
    assert (used.micro_batch_size, used.gradient_checkpointing) == (1, "always")
    tried.clear()
    with pytest.raises(torch.OutOfMemoryError):
        pvtrain.gradients_within_memory(student, teacher, windows, torch.arange(4), used, torch.device("cpu"),
                                        layers, [], 1)
    assert tried == [(1, "always", True)]


def test_adam_with_moments_in_host_memory_takes_torch_adams_steps_and_resumes():
    """HostMomentsAdam (the P-step's Adam beside a host-resident V-step) against torch.optim.Adam:
    the same parameters after three steps, also where a fresh optimiser loads the state saved
    after two steps and takes the third; its moments stay in host memory."""
    from aqflow.pvtune.offload import HostMomentsAdam

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
    gradients = [[torch.randn_like(p) for p in start] for _ in range(3)]

    def run(make, steps, values=start, state=None):
        params = [torch.nn.Parameter(p.detach().clone()) for p in values]
        optimizer = make(params)
        if state is not None:
            optimizer.load_state_dict(state)
        for step in steps:
            for p, g in zip(params, gradients[step]):
                p.grad = g.clone()
            optimizer.step()
        return params, optimizer

    settings = dict(lr=1e-2, betas=(0.9, 0.95))
    expected, _ = run(lambda params: torch.optim.Adam(params, **settings), range(3))
    whole, _ = run(lambda params: HostMomentsAdam(params, **settings), range(3))
    halfway, saved = run(lambda params: HostMomentsAdam(params, **settings), range(2))
    resumed, optimizer = run(lambda params: HostMomentsAdam(params, **settings), [2], halfway, saved.state_dict())
    for got in (whole, resumed):
        for value, reference, first in zip(got, expected, start):
            torch.testing.assert_close(value, reference, rtol=0, atol=1e-7)
            assert not torch.allclose(value, first)
    assert all(optimizer.state[p]["exp_avg_sq"].device.type == "cpu" for p in resumed)


def test_plateau_is_reached_when_the_last_evaluations_fail_to_beat_the_best_before_them():
    reached = pvtrain.plateau_reached
    assert not reached([1.0, 0.9, 0.8], None, 0.01)  # off
    assert not reached([1.0, 0.99], 2, 0.01)  # too few evaluations to tell
    assert reached([1.0, 0.995, 0.992], 2, 0.01)  # neither beat 1.0 by 1 %
    assert not reached([1.0, 0.995, 0.98], 2, 0.01)  # the last did
    assert reached([1.0, 0.8, 0.85, 0.9], 2, 0.0)  # worse than the best before them
    assert not reached([1.0, 0.8, 0.85, 0.79], 2, 0.0)


def test_training_stops_at_a_plateau_and_keeps_the_best_state(setup):
    """A learning rate large enough that the held-out KL rises after its first steps: with
    plateau_evaluations 2 the loop ends two evaluations after its best, short of its budget,
    and the student is the best state's."""
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)
    settings = pvtrain.PVSettings(epochs=5, plateau_evaluations=2, plateau_min_improvement=0.0,
                                  **(QUICK | dict(lr=3e-2, code_lr=3e-2, eval_every_steps=1)))
    heldout = setup["data"].heldout.input_ids
    result = pvtrain.train(student, teacher, setup["data"].train.input_ids, heldout, settings, "cpu", progress=False)
    evals = [row for row in result.log if row["split"] == "heldout"]
    assert result.budget_steps == 10 and result.stopped_at_plateau and result.steps < 10
    assert result.steps == result.best_step + 2 == evals[-1]["step"]
    assert min(row["kl"] for row in evals[-2:]) >= result.best_heldout["kl"]
    final = pvtrain.heldout_metrics(student, teacher, heldout, settings, torch.device("cpu"))
    assert final["kl"] == pytest.approx(result.best_heldout["kl"], rel=1e-5)


def test_compiled_blocks_give_the_eager_run(setup, monkeypatch):
    """compile_blocks traces each decoder block (aot_eager here: inductor's graphs and autograd
    without its code generation, which a CPU test cannot afford) with the quantized linears left
    out: same held-out and training KL, same codes, and the blocks are eager again afterwards."""
    from aqflow.pvtune import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    runs = {}
    for choice in ("never", "always"):
        result, student = _fresh_run(setup, epochs=1, compile_blocks=choice, lr=3e-2, code_lr=3e-2)
        runs[choice] = ([row["kl"] for row in result.log], _codes(student), result.compiled_blocks)
        assert all(block._compiled_call_impl is None for block in student.model.layers)
    assert runs["never"][2] is False and runs["always"][2] is True
    np.testing.assert_allclose(runs["always"][0], runs["never"][0], rtol=1e-5)
    assert all(torch.equal(runs["always"][1][name], codes) for name, codes in runs["never"][1].items())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something was compiled
    assert not pvtrain.compiling("auto", torch.device("cpu"), 1) and pvtrain.compiling("auto", torch.device("cuda"), 1)
    assert not pvtrain.compiling("auto", torch.device("cuda"), 2)


def test_each_process_gets_as_many_batches_padding_the_short_ones():
    batches = [pvtrain.rank_batches(7, 2, rank, 3) for rank in range(3)]  # 4 batches over 3 processes
    assert batches[0] == [slice(0, 2), slice(6, 7)]
    assert batches[1] == [slice(2, 4), None] and batches[2] == [slice(4, 6), None]
    assert pvtrain.rank_batches(4, 2, 0, 1) == [slice(0, 2), slice(2, 4)]


def test_weights_kept_between_optimiser_steps_give_the_same_run(setup):
    """keep_weights (each layer's dequantized weight made once a step, not once per pass) changes
    nothing: the kept weights are dropped whenever an optimiser step moves what they are made of."""
    logs = []
    for keep in ("never", "always"):
        result, student = _fresh_run(setup, epochs=2, keep_weights=keep, lr=3e-2, code_lr=3e-2, eval_every_steps=1)
        logs.append([(row["split"], row["kl"]) for row in result.log])
        assert all(layer.weight_cache is None for layer in pv_linears(student).values())  # released at the end
    assert logs[0] == logs[1] and len({kl for split, kl in logs[0] if split == "heldout"}) == 5
