"""The generate and speed stages on a tiny Llama and a tiny AQLM checkpoint of it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from aqflow.evaluation.dense_aqlm import dequantize_aqlm_linears
from aqflow.inference import register_kernel
from aqflow.inference.decode import greedy_decode
from aqflow.inference.runtime import load_for_decoding, resident_weight_bytes
from aqflow.models import build_tiny_llama, load_tokenizer
from aqflow.stagekit.stage_cli import run_stage_module
from aqflow.stages import generate, speed
from tests.inference.aqlm_checkpoints import write_random_aqlm_checkpoint
from tests.inference.cpu_kernel_cases import cpu_kernel  # noqa: F401  (a fixture: each CPU kernel here in turn)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    fp_dir = build_tiny_llama(root / "fp", hidden_size=64, intermediate_size=128, num_layers=2, seed=0)
    write_random_aqlm_checkpoint(fp_dir, root / "aqlm", num_codebooks=2, nbits=8, group_size=8)
    return fp_dir, root / "aqlm"


def _generate(model_dir, output, **settings):
    return run_stage_module(generate, generate.GenerateSettings(device="cpu", **settings),
                            generate.GeneratePaths(model_dir=model_dir, output=output))


def test_generate_streams_the_greedy_tokens_of_the_dequantized_model(folders, tmp_path, capsys):
    _, aqlm_dir = folders
    prompt = "the quick brown fox"
    assert _generate(aqlm_dir, tmp_path / "fast.json", prompt=prompt, max_new_tokens=8) == 0
    record = json.loads((tmp_path / "fast.json").read_text())
    reference = load_for_decoding(aqlm_dir, "cpu", "float32", "plain")
    quantized = dequantize_aqlm_linears(reference)
    tokenizer = load_tokenizer(aqlm_dir)
    expected, _ = greedy_decode(reference, tokenizer(prompt, return_tensors="pt").input_ids, 8,
                                stop_tokens={tokenizer.eos_token_id}, fuse=False)  # its linears stay as loaded
    assert record["tokens"] == expected.tolist()
    out = capsys.readouterr().out
    assert out.startswith(prompt + record["text"]) and "tokens/s" in out.splitlines()[-1]
    assert record["format"] == "aqlm" and record["timings"]["decode_tokens_per_second"] > 0
    # held: the dense model's bytes with each linear's float32 weight swapped for its codes (one
    # byte per 8-bit code, 2 per group of 8), codebooks [2, 256, 8] and scales [out], float32
    linears = [reference.get_submodule(name) for name in quantized]
    expected = (resident_weight_bytes(reference) - sum(4 * l.weight.numel() for l in linears)
                + sum(l.weight.numel() // 8 * 2 + 4 * 2 * 256 * 8 + 4 * l.out_features for l in linears))
    assert record["resident_weight_bytes"] == expected
    # aqlm's own kernels (one numba thread) pick the same tokens
    assert _generate(aqlm_dir, tmp_path / "plain.json", prompt=prompt, max_new_tokens=8, path="plain") == 0
    assert json.loads((tmp_path / "plain.json").read_text())["tokens"] == record["tokens"]


@pytest.fixture(scope="module")
def dequantized_tokens(folders):
    """The greedy tokens of the AQLM checkpoint's dequantized model after generate's default prompt (8 new)."""
    _, aqlm_dir = folders
    reference = load_for_decoding(aqlm_dir, "cpu", "float32", "plain")
    dequantize_aqlm_linears(reference)
    tokenizer = load_tokenizer(aqlm_dir)
    tokens, _ = greedy_decode(reference, tokenizer(generate.GenerateSettings().prompt, return_tensors="pt").input_ids, 8,
                              stop_tokens={tokenizer.eos_token_id}, fuse=False)
    return tokens.tolist()


def test_generate_names_its_cpu_kernel_and_each_kernel_picks_the_same_tokens(folders, dequantized_tokens, tmp_path,
                                                                             capsys, cpu_kernel):
    """On each CPU kernel this machine has (AQFLOW_CPU_KERNEL forced: avx512, avx2, numba, ...) the fast
    path picks the dequantized model's tokens, and generate prints and records the kernel it used."""
    _, aqlm_dir = folders
    assert _generate(aqlm_dir, tmp_path / "fast.json", max_new_tokens=8, stream=False) == 0
    record = json.loads((tmp_path / "fast.json").read_text())
    assert record["tokens"] == dequantized_tokens
    assert record["cpu_kernel"] == cpu_kernel and f"CPU kernel {cpu_kernel})" in capsys.readouterr().out


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(folders, tmp_path):
    fp_dir, _ = folders
    runs = {}
    for name, settings in {"a": dict(seed=1), "b": dict(seed=1), "c": dict(seed=2)}.items():
        assert _generate(fp_dir, tmp_path / f"{name}.json", max_new_tokens=12, temperature=5.0, stream=False, **settings) == 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())["tokens"]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]
    assert _generate(fp_dir, tmp_path / "greedy.json", max_new_tokens=6, stream=False) == 0
    assert _generate(fp_dir, tmp_path / "top.json", max_new_tokens=6, temperature=1.0, top_p=1e-6, stream=False) == 0
    greedy = json.loads((tmp_path / "greedy.json").read_text())["tokens"]
    assert json.loads((tmp_path / "top.json").read_text())["tokens"] == greedy


def test_sampling_goes_through_the_one_token_cpu_paths_and_draws_the_stock_tokens(folders, tmp_path):
    fp_dir, _ = folders
    assert _generate(fp_dir, tmp_path / "fast.json", max_new_tokens=10, temperature=3.0, seed=4, stream=False) == 0
    record = json.loads((tmp_path / "fast.json").read_text())
    assert record["timings"]["cpu_layers"] == 2 * 3 + 1 and record["timings"]["attention"] != "model's own"
    model = load_for_decoding(fp_dir, "cpu", "float32", "fast")
    prompt = load_tokenizer(fp_dir)(generate.GenerateSettings().prompt, return_tensors="pt").input_ids
    stock, timings = generate.sample_decode(model, prompt, 10, temperature=3.0, top_p=1.0,
                                            generator=torch.Generator().manual_seed(4), fast_attention=False)
    assert (timings.cpu_layers, timings.attention) == (0, "model's own")
    assert stock.tolist() == record["tokens"]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.1]))
    kept = generate.top_p_filter(logits, 0.75).isfinite()
    assert kept.tolist() == [False, True, True, False]
    assert generate.top_p_filter(logits, 1.0).isfinite().all()


def test_speed_measures_the_paths_it_is_given_per_device(folders, tmp_path, capsys):
    """The AQLM checkpoint through the fast path (its plain path skipped by cpu_plain_tokens 0), the fp
    model through the plain one, on the CPU with the CPU's token counts (aqlm's own CPU kernel compiles
    for half a minute per process: generate's test runs it)."""
    fp_dir, aqlm_dir = folders
    payloads = {}
    for name, folder, paths in (("aqlm", aqlm_dir, ("fast", "plain")), ("fp", fp_dir, ("plain",))):
        settings = speed.SpeedSettings(devices=("cpu",), paths=paths, prompt_tokens=4, new_tokens=6, warmup_tokens=1,
                                       prefill_tokens=32, cpu_new_tokens=4, cpu_prefill_tokens=16, cpu_plain_tokens=0,
                                       threads=1)
        assert run_stage_module(speed, settings, speed.SpeedPaths(model_dir=folder, output=tmp_path / f"{name}.json")) == 0
        payloads[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert list(payloads[name]["devices"]) == ["cpu"] and payloads[name]["format"] == ("aqlm" if name == "aqlm" else "plain")
    aqlm, fp = payloads["aqlm"], payloads["fp"]
    # the job's log says which path is being measured and how long it took
    log = capsys.readouterr().out
    assert "speed: the fast path on cpu (float32, 4 new tokens" in log and log.count("measured in") == 2
    cpu = aqlm["devices"]["cpu"]
    assert list(cpu["paths"]) == ["fast"] and "cpu_plain_tokens" in cpu["skipped_paths"]["plain"]
    assert list(fp["devices"]["cpu"]["paths"]) == ["plain"] and "skipped_paths" not in fp["devices"]["cpu"]
    # the threads asked for (starting numba's threading layer once reset torch's count to all cores)
    assert cpu["kind"] == "cpu" and cpu["dtype"] == "float32" and cpu["threads"] == 1 and cpu["name"]
    # the one-device layout's keys: the first device's section
    assert (aqlm["device"], aqlm["device_name"], aqlm["paths"]) == ("cpu", cpu["name"], cpu["paths"])
    assert aqlm["settings"]["devices"] == ["cpu"] and aqlm["settings"]["cpu_prefill_tokens"] == 16
    assert aqlm["versions"]["numba"] and aqlm["cpu_cores"] >= 1
    for result in (cpu["paths"]["fast"], fp["devices"]["cpu"]["paths"]["plain"]):
        assert result["decode_tokens_per_second"] > 0 and result["prefill_tokens_per_second"] > 0
        # the CPU's counts, not the GPU's
        assert result["decode"]["timed_steps"] == 3 and result["prefill"]["prompt_tokens"] == 16
        assert result["tokens"] == {"prompt_tokens": 4, "new_tokens": 4, "warmup_tokens": 1, "prefill_tokens": 16}
        assert result["peak_memory_bytes"] >= result["rss_before_load_bytes"] > 0
    fast = load_for_decoding(aqlm_dir, "cpu", "float32", "fast")
    assert cpu["paths"]["fast"]["resident_weight_bytes"] == resident_weight_bytes(fast)
    # the kernel the 2-bit layers took in the measuring child (this process's choice: the same settings)
    assert cpu["paths"]["fast"]["cpu_kernel"] == register_kernel.kernel_name()
    assert fp["devices"]["cpu"]["paths"]["plain"]["cpu_kernel"] is None  # nothing 2-bit to look up
    assert fp["paths"]["plain"]["resident_weight_bytes"] == resident_weight_bytes(load_for_decoding(fp_dir, "cpu", "float32", "plain"))
    assert aqlm["bits_per_parameter"] < fp["bits_per_parameter"] == 32  # the tiny model's codebooks weigh much
    assert 0 < aqlm["disk_weight_bytes"] < fp["disk_weight_bytes"]


def test_auto_is_the_gpu_and_the_cpu_where_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert speed.resolve_devices(("auto",)) == ("cpu",)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert speed.resolve_devices(("auto",)) == ("cuda", "cpu")
    assert speed.resolve_devices(("cpu", "cuda:1")) == ("cpu", "cuda:1")
    assert [speed.device_kind(device) for device in ("cuda", "cuda:1", "cpu")] == ["gpu", "gpu", "cpu"]


def test_each_device_and_path_gets_its_token_counts():
    settings = speed.SpeedSettings(prompt_tokens=32, new_tokens=256, warmup_tokens=8, prefill_tokens=1024,
                                   cpu_new_tokens=16, cpu_prefill_tokens=128, cpu_plain_tokens=4)
    gpu = {"prompt_tokens": 32, "new_tokens": 256, "warmup_tokens": 8, "prefill_tokens": 1024}
    for path in ("fast", "plain"):
        for aqlm in (True, False):
            assert speed.token_counts(settings, "cuda:0", path, aqlm) == gpu
    cpu = {"prompt_tokens": 32, "new_tokens": 16, "warmup_tokens": 8, "prefill_tokens": 128}
    assert speed.token_counts(settings, "cpu", "fast", True) == speed.token_counts(settings, "cpu", "plain", False) == cpu
    # aqlm's numba kernel: a few tokens everywhere, a one-token warm-up; 0 skips it
    assert speed.token_counts(settings, "cpu", "plain", True) == {"prompt_tokens": 4, "new_tokens": 4,
                                                                  "warmup_tokens": 1, "prefill_tokens": 4}
    assert speed.token_counts(dataclasses.replace(settings, cpu_plain_tokens=0), "cpu", "plain", True) is None


def test_the_plain_path_decodes_eagerly_with_nothing_fused(folders, monkeypatch):
    """greedy_decode fuses q/k/v and gate/up and captures a graph on CUDA unless told not to: every
    call the plain path makes tells it not to; the fast path leaves both to the device."""
    import aqflow.inference.decode as decode

    fp_dir, _ = folders
    calls = []

    def recording(*args, **kwargs):
        calls.append({key: kwargs.get(key) for key in ("graphs", "fuse")})
        return greedy_decode(*args, **kwargs)

    monkeypatch.setattr(decode, "greedy_decode", recording)
    counts = {"prompt_tokens": 3, "new_tokens": 2, "warmup_tokens": 1, "prefill_tokens": 4}
    for path in ("plain", "fast"):
        calls.clear()
        speed.measure(str(fp_dir), "cpu", "float32", path, {"threads": 1, "seed": 0, "repeats": 1, **counts})
        assert len(calls) == 3  # warm-up, decode, prefill
        if path == "plain":
            assert all(call == {"graphs": False, "fuse": False} for call in calls)
        else:
            assert [call["fuse"] for call in calls] == [None] * 3 and calls[1]["graphs"] is None


def test_speed_refuses_bad_devices(folders, tmp_path, capsys, monkeypatch):
    _, aqlm_dir = folders
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for devices in (("auto", "cpu"), ("cpu", "cpu"), ("gpu",), ("cuda",)):
        settings = speed.SpeedSettings(devices=devices)
        assert run_stage_module(speed, settings, speed.SpeedPaths(model_dir=aqlm_dir, output=tmp_path / "s.json")) == 2
        assert "--devices" in capsys.readouterr().err and not (tmp_path / "s.json").exists()


def test_speed_refuses_an_unknown_path(folders, tmp_path, capsys):
    _, aqlm_dir = folders
    settings = speed.SpeedSettings(devices=("cpu",), paths=("fast", "fastest"))
    assert run_stage_module(speed, settings, speed.SpeedPaths(model_dir=aqlm_dir, output=tmp_path / "s.json")) == 2
    assert "fastest" in capsys.readouterr().err and not (tmp_path / "s.json").exists()
