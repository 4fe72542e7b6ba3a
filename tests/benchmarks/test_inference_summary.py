"""benchmarks/inference_summary.py: the issue's figures are the median over the machines given, the lowest
and each machine's own figures beside them, and GPU files of two cards are refused."""

import json

import pytest

from benchmarks.inference_summary import summary


def gpu_file(path, device, rates):
    """rates: {model: (bf16 eager, bf16 graph, 2 bpp graph, 2 bpp floor run)} tokens/s."""
    models, record = {}, {"device": device}
    for name, (eager, graph, ours, floor) in rates.items():
        models[name] = {"bf16": {"eager": {"decode_tokens_per_second": eager},
                                 "graph": {"decode_tokens_per_second": graph}},
                        "ours": {"graph": {"decode_tokens_per_second": ours},
                                 "floor_norms": {"decode_tokens_per_second": floor}}}
        record[f"gpu_decode_speedup_{name}"] = ours / graph
    record["models"] = models
    path.write_text(json.dumps(record))
    return path


def cpu_file(path, dense, quantized):
    path.write_text(json.dumps({
        "cpu_decode_speedup_3b": quantized / dense, "machine": {"cpu": "x86", "cores": 16},
        "decode_3b": [{"variant": "dense bf16", "decode_tokens_per_second": dense},
                      {"variant": "2x8 fast (bf16 rest)", "decode_tokens_per_second": quantized}]}))
    return path


def test_each_figure_is_the_median_over_machines_with_the_lowest_beside_it(tmp_path):
    gpus = [gpu_file(tmp_path / f"g{i}.json", "H", {"3b": (8.0, bf16, ours, 9e9), "8b": (5.0, 200.0, 500.0, 9e9)})
            for i, (bf16, ours) in enumerate([(400.0, 820.0), (420.0, 800.0), (410.0, 830.0)])]
    cpus = [cpu_file(tmp_path / f"c{i}.json", dense, 20.0) for i, dense in enumerate([8.0, 10.0, 12.5])]
    record = summary(gpus, cpus)
    assert record["gpu_decode_speedup_3b"] == pytest.approx(830 / 410)  # the median of 2.050, 1.905, 2.024
    assert record["gpu_decode_speedup_3b_lowest"] == pytest.approx(800 / 420)
    assert record["gpu_decode_speedup_8b"] == pytest.approx(2.5) and record["met"]["gpu_decode_speedup_8b"]
    assert record["cpu_decode_speedup_3b"] == pytest.approx(2.0) and record["cpu_decode_speedup_3b_lowest"] == 1.6
    first = record["gpu_decode_by_machine"][0]
    assert (first["bf16_3b_tokens_per_second"], first["quantized_3b_tokens_per_second"]) == (400.0, 820.0)
    assert record["sources"]["gpu"] == [str(path) for path in gpus]


def test_gpu_files_of_two_cards_are_refused(tmp_path):
    rates = {"3b": (8.0, 400.0, 800.0, 0.0), "8b": (5.0, 200.0, 500.0, 0.0)}
    gpus = [gpu_file(tmp_path / "a.json", "NVIDIA H200", rates), gpu_file(tmp_path / "b.json", "NVIDIA H100", rates)]
    with pytest.raises(SystemExit, match="several cards"):
        summary(gpus, [cpu_file(tmp_path / "c.json", 10.0, 20.0)])
