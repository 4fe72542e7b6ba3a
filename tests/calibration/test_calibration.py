"""Per-block XᵀX on tiny random models built on the fly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, Qwen2Config

from aqflow.calibration import (
    BlockXtx,
    accumulate_block_xtx,
    block_forward,
    capture_block_inputs,
    collect_xtx_fp,
    discover_input_sites,
    group_linears_by_input,
    load_block_xtx,
    load_manifest,
    save_block_xtx,
)
from aqflow.models import build_tiny_llama, find_decoder_blocks, find_linears, load_causal_lm

NUM_WINDOWS, WINDOW_TOKENS = 5, 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_causal_lm(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=1))


@pytest.fixture(scope="module")
def windows(model):
    return torch.randint(0, model.config.vocab_size, (NUM_WINDOWS, WINDOW_TOKENS),
                         generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def stats(model, windows):
    return collect_xtx_fp(model, windows, batch_size=2, progress=False)


def test_finds_the_decoder_blocks(model):
    name, blocks = find_decoder_blocks(model)
    assert name == "model.layers" and len(blocks) == 2


def test_sites_cover_each_blocks_linears_exactly_once(model, stats):
    _, blocks = find_decoder_blocks(model)
    for i, block in enumerate(blocks):
        linears = [lin for site in stats[i].sites for lin in site.linears]
        assert sorted(linears) == sorted(find_linears(block))
        assert len(linears) == len(set(linears)) == 7
        assert [site.linears for site in stats[i].sites] == [
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("self_attn.o_proj",),
            ("mlp.gate_proj", "mlp.up_proj"),
            ("mlp.down_proj",),
        ]
        assert stats[i].site_of("self_attn.k_proj").site_id == "self_attn.q_proj+self_attn.k_proj+self_attn.v_proj"
        assert {s.site_id: s.in_features for s in stats[i].sites}["mlp.down_proj"] == 128


def test_xtx_equals_xt_x_of_the_captured_inputs(model, windows, stats):
    """Capture every linear's input by hand (not only each site's first) and compare."""
    _, blocks = find_decoder_blocks(model)
    captured: dict[tuple[int, str], list[torch.Tensor]] = {}
    handles = []
    for i, block in enumerate(blocks):
        for name, linear in find_linears(block).items():
            store = captured.setdefault((i, name), [])
            hook = lambda module, args, _store=store: _store.append(args[0].detach().clone())  # noqa: E731
            handles.append(linear.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=windows, use_cache=False)
    for handle in handles:
        handle.remove()
    for (i, name), inputs in captured.items():
        x = torch.cat(inputs).reshape(-1, inputs[0].shape[-1]).double()  # [tokens, in]
        site = stats[i].site_of(name)
        torch.testing.assert_close(stats[i].xtx[site.site_id], x.T @ x, rtol=1e-9, atol=1e-9)
        assert stats[i].tokens[site.site_id] == NUM_WINDOWS * WINDOW_TOKENS == x.shape[0]


def test_group_linears_by_input_groups_same_or_equal_tensors():
    a = torch.randn(2, 3, 4)
    b = torch.randn(2, 3, 4)
    groups = group_linears_by_input({"q": a, "k": a, "v": a.clone(), "o": b, "gate": b[..., :2]})
    assert groups == [("q", "k", "v"), ("o",), ("gate",)]


def test_selected_blocks_match_the_full_run(model, windows, stats):
    only_first = collect_xtx_fp(model, windows, block_indices=[0], batch_size=5, progress=False)
    assert list(only_first) == [0]
    for site_id, xtx in stats[0].xtx.items():
        torch.testing.assert_close(only_first[0].xtx[site_id], xtx)
    with pytest.raises(ValueError, match="within"):
        collect_xtx_fp(model, windows, block_indices=[2], progress=False)


def test_block_by_block_reproduces_fp_mode(model, windows, stats):
    """The sequential-mode building blocks: chaining blocks gives the model's hidden states, and
    accumulating block by block gives the same XᵀX as the one-pass fp mode (no quantization)."""
    _, blocks = find_decoder_blocks(model)
    with torch.no_grad():
        reference = model(input_ids=windows, output_hidden_states=True, use_cache=False).hidden_states
    inputs = capture_block_inputs(model, windows)
    torch.testing.assert_close(inputs.hidden_states, reference[0])
    hidden = inputs.hidden_states
    for i, block in enumerate(blocks):
        block_stats = BlockXtx(i, stats[i].sites,
                               {k: torch.zeros_like(v) for k, v in stats[i].xtx.items()},
                               {k: 0 for k in stats[i].tokens})
        out = accumulate_block_xtx(block, block_stats, inputs, hidden)
        torch.testing.assert_close(out, block_forward(block, inputs, hidden))
        for site_id, xtx in stats[i].xtx.items():
            torch.testing.assert_close(block_stats.xtx[site_id], xtx, rtol=1e-9, atol=1e-9)
            assert block_stats.tokens[site_id] == stats[i].tokens[site_id]
        if i + 1 < len(blocks):  # the last entry of hidden_states is after the final norm
            torch.testing.assert_close(out, reference[i + 1])
        hidden = out


def test_artifacts_round_trip_without_pickles(stats, tmp_path):
    manifest = save_block_xtx(tmp_path, stats, source_data_id="random-tokens/5x12/seed0")
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".sha256") == ["block0.npz", "block1.npz", "manifest.parquet"]
    assert len(manifest) == 8
    assert set(manifest.columns) >= {"block", "site", "linears", "shape", "tokens", "sha256", "source_data_id"}
    reread = load_manifest(tmp_path, verify=True)
    assert list(reread.loc[0, "linears"]) == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    assert (reread["tokens"] == NUM_WINDOWS * WINDOW_TOKENS).all()
    loaded = load_block_xtx(tmp_path / "block1.npz")  # np.load with allow_pickle=False inside
    assert [s.linears for s in loaded.sites] == [s.linears for s in stats[1].sites]
    for site_id, xtx in stats[1].xtx.items():
        # stored in float32, the quantizer's precision (the float64 sums rounded once)
        assert torch.equal(loaded.xtx[site_id], xtx.float()) and loaded.xtx[site_id].dtype == torch.float32
    with np.load(tmp_path / "block0.npz") as data:  # corrupt one array: the checksum must notice
        arrays = {k: data[k] for k in data.files}
    arrays["xtx/mlp.down_proj"][0, 0] += 1.0
    np.savez(tmp_path / "block0.npz", **arrays)
    with pytest.raises(ValueError, match="sha256"):
        load_manifest(tmp_path, verify=True)


TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "config, expected",
    [
        (Qwen2Config(**TINY, num_key_value_heads=2), [3, 1, 2, 1]),  # q/k/v with bias
        (OPTConfig(vocab_size=97, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                   word_embed_proj_dim=32), [3, 1, 1, 1]),  # OPT: q/k/v, out_proj, fc1, fc2
        (LlamaConfig(**TINY, num_key_value_heads=4, mlp_bias=True, attention_bias=True), [3, 1, 2, 1]),
    ],
    ids=["qwen2", "opt", "llama-bias"],
)
def test_sites_are_found_generically(config, expected):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    sites = discover_input_sites(model, torch.randint(0, 97, (1, 8)))
    _, blocks = find_decoder_blocks(model)
    for i, block in enumerate(blocks):
        assert [len(s.linears) for s in sites[i]] == expected
        assert sorted(lin for s in sites[i] for lin in s.linears) == sorted(find_linears(block))


def _member_offset(path, member):
    """Where the bytes of NPZ member `member` (e.g. 'xtx/mlp.down_proj.npy') start in the file."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, "rb") as handle:  # local header: 30 bytes, then the name and the extra field
        handle.seek(info.header_offset + 26)
        name_length, extra_length = np.frombuffer(handle.read(4), dtype="<u2")
    return info.header_offset + 30 + int(name_length) + int(extra_length)


def _flip(path, offset):
    from aqflow.io import artifacts

    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    artifacts._VERIFIED.clear()


def test_a_layer_job_reads_its_site_verified_without_hashing_the_block_file(stats, tmp_path, monkeypatch):
    """`site_xtx`: the site's array equals what was saved, and only the manifest is hashed whole;
    a changed byte of that array, a truncated block file or an edited manifest is refused naming
    the file ('corrupt: sha256'); a changed byte of another site's array is refused by the job
    that reads that site."""
    from aqflow.io import artifacts
    from aqflow.calibration.site_xtx import read_site_xtx, site_row

    root = tmp_path / "calib"
    with artifacts.atomic_dir(root) as staging:
        save_block_xtx(staging, stats, source_data_id="random")
    hashed = []
    real_file_sha256 = artifacts.file_sha256
    monkeypatch.setattr(artifacts, "file_sha256", lambda path: hashed.append(path.name) or real_file_sha256(path))
    down, up = site_row(root, 1, "mlp.down_proj"), site_row(root, 1, "mlp.up_proj")
    assert site_row(root, 1, "mlp.nothing") is None and up["site"] == "mlp.gate_proj+mlp.up_proj"
    for row in (down, up):
        assert np.array_equal(read_site_xtx(root, row), stats[1].xtx[row["site"]].float().numpy())
    assert set(hashed) == {"manifest.parquet"}  # the block file is not hashed whole

    block = root / "block1.npz"
    _flip(block, _member_offset(block, "xtx/mlp.down_proj.npy") + 200)
    assert np.array_equal(read_site_xtx(root, up), stats[1].xtx[up["site"]].float().numpy())  # its bytes are intact
    with pytest.raises(artifacts.ArtifactError, match=f"{block}: corrupt: sha256"):
        read_site_xtx(root, down)
    _flip(block, _member_offset(block, "xtx/mlp.down_proj.npy") + 200)
    data = block.read_bytes()
    block.write_bytes(data[: len(data) // 2])
    artifacts._VERIFIED.clear()
    with pytest.raises(artifacts.ArtifactError, match=f"{block}: corrupt: sha256"):
        read_site_xtx(root, up)
    block.write_bytes(data)
    _flip(root / "manifest.parquet", (root / "manifest.parquet").stat().st_size // 2)
    with pytest.raises(artifacts.ArtifactError, match="manifest.parquet: corrupt: sha256"):
        site_row(root, 1, "mlp.down_proj")
