"""Sequential propagation and block fine-tuning on a tiny random Llama of 3 blocks, through the stage CLIs.

The reference for block i's XᵀX is computed independently: the whole model with the weights of
blocks < i replaced by what their codes represent (dequantized here from the artifacts' format
definition), run in one ordinary forward pass, with block i's linear inputs captured by hooks.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from aqflow.io import artifacts
from aqflow.calibration import collect_xtx_fp, load_block_xtx, save_block_xtx
from aqflow.calibration.block_finetune import BlockFinetuneSettings, QuantizedLinearParams, finetune_block
from aqflow.calibration.hessians import block_forward
from aqflow.calibration.sequential import block_call_inputs, load_hidden_states, save_windows
from aqflow.checkpoint import write_aqlm_checkpoint
from aqflow.models import build_tiny_llama, find_decoder_blocks, find_linears, load_causal_lm
from aqflow.quant.representation import dequantize_weight, unpack_codes
from aqflow.quant.quantize import QuantizerSettings
from aqflow.stagekit.stage_cli import run_stage_module
from aqflow.stages import calibrate_block, finetune_block as finetune_stage, quantize_layer

NUM_WINDOWS, WINDOW_TOKENS, NUM_BLOCKS = 6, 16, 3
QUANTIZE = quantize_layer.QuantizeLayerSettings(
    quantizer=QuantizerSettings(num_codebooks=1, nbits=4, init="greedy", beam_size=1, max_epochs=0, kmeans_max_iter=10),
    device="cpu", quiet=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A model folder, the shared calibration (block 0 from the fp model) and the windows."""
    root = tmp_path_factory.mktemp("seq")
    model_dir = build_tiny_llama(root / "model", num_layers=NUM_BLOCKS, seed=3)
    model = load_causal_lm(model_dir)
    windows = torch.randint(0, model.config.vocab_size, (NUM_WINDOWS, WINDOW_TOKENS),
                            generator=torch.Generator().manual_seed(0))
    shared = root / "calib"
    fp_stats = collect_xtx_fp(model, windows, progress=False)
    with artifacts.atomic_dir(shared) as staging:
        save_block_xtx(staging, {0: fp_stats[0]}, "random-tokens")
        save_windows(staging / "windows.safetensors", windows)
        artifacts.write_json(staging / "calibration.json", {"propagation": "sequential", "source": "random-tokens"})
    return root, model_dir, shared, windows, fp_stats


def quantize_block(model_dir, calibration_dir, layers_dir, block: int) -> None:
    model = load_causal_lm(model_dir)
    prefix, blocks = find_decoder_blocks(model)
    for name in find_linears(blocks[block]):
        layer = f"{prefix}.{block}.{name}"
        paths = quantize_layer.QuantizeLayerPaths(model_dir=model_dir, calibration_dir=calibration_dir, layer=layer,
                                                  output=layers_dir / f"{layer}.safetensors",
                                                  metrics=layers_dir / f"{layer}.json")
        assert run_stage_module(quantize_layer, QUANTIZE, paths) == 0


def calibrate_next(model_dir, shared, root, layers_dir, block: int, previous_block_tensors=None,
                   previous_inputs=None) -> None:
    settings = calibrate_block.CalibrateBlockSettings(block=block, batch_size=4, quiet=True)
    paths = calibrate_block.CalibrateBlockPaths(
        model_dir=model_dir, calibration_dir=shared, previous_layers_dir=layers_dir, output_dir=root / f"block{block}",
        inputs_output=root / f"block{block}.inputs.safetensors", previous_block_tensors=previous_block_tensors,
        previous_inputs=(previous_inputs or root / f"block{block - 1}.inputs.safetensors") if block >= 2 else None)
    assert run_stage_module(calibrate_block, settings, paths) == 0


@pytest.fixture(scope="module")
def chain(setup):
    """Blocks 0 and 1 quantized in sequential mode; blocks 1 and 2 calibrated."""
    root, model_dir, shared, _, _ = setup
    layers = root / "layers"
    quantize_block(model_dir, shared, layers, 0)
    calibrate_next(model_dir, shared, root, layers, 1)
    quantize_block(model_dir, root / "block1", layers, 1)
    calibrate_next(model_dir, shared, root, layers, 2)
    return layers


def dequantized_model(model_dir, layers_dir, blocks):
    """The fp model with the linears of `blocks` replaced by the weights their artifacts represent."""
    model = load_causal_lm(model_dir)
    prefix, _ = find_decoder_blocks(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and any(name.startswith(f"{prefix}.{b}.") for b in blocks):
                t = load_file(str(layers_dir / f"{name}.safetensors"))
                codes = unpack_codes(t["codes"], t["codebooks"].shape[1].bit_length() - 1)
                module.weight.copy_(dequantize_weight(codes, t["codebooks"], t["scales"]))
    return model


def reference_xtx(model, windows, block: int) -> dict[str, torch.Tensor]:
    """linear name -> XᵀX [in, in] float64 of its input in block `block`, from one full forward pass."""
    _, blocks = find_decoder_blocks(model)
    seen = {}
    handles = [linear.register_forward_pre_hook(lambda m, args, _n=name: seen.__setitem__(_n, args[0]))
               for name, linear in find_linears(blocks[block]).items()]
    with torch.no_grad():
        model(input_ids=windows, use_cache=False)
    for handle in handles:
        handle.remove()
    out = {}
    for name, x in seen.items():
        flat = x.reshape(-1, x.shape[-1]).double()
        out[name] = flat.T @ flat
    return out


def test_block_i_xtx_equals_the_quantized_models_and_differs_from_fp(setup, chain):
    root, model_dir, _, windows, fp_stats = setup
    for block, quantized_before in ((1, [0]), (2, [0, 1])):
        stats = load_block_xtx(root / f"block{block}" / f"block{block}.npz")
        reference = reference_xtx(dequantized_model(model_dir, chain, quantized_before), windows, block)
        for site in stats.sites:
            assert stats.tokens[site.site_id] == NUM_WINDOWS * WINDOW_TOKENS
            for linear in site.linears:
                torch.testing.assert_close(stats.xtx[site.site_id], reference[linear].float(), rtol=1e-6, atol=1e-6)  # stored in float32
            fp = fp_stats[block].xtx[site.site_id]
            assert (stats.xtx[site.site_id] - fp).norm() > 1e-3 * fp.norm()  # quantization reached block i
        summary = json.loads((root / f"block{block}" / "calibration.json").read_text())
        assert summary["propagation"] == "sequential" and summary["block"] == block


def test_propagated_hidden_states_are_the_quantized_models(setup, chain):
    root, model_dir, _, windows, _ = setup
    model = dequantized_model(model_dir, chain, [0, 1])
    with torch.no_grad():
        reference = model(input_ids=windows, output_hidden_states=True, use_cache=False).hidden_states
    hidden = load_hidden_states(root / "block2.inputs.safetensors", windows)
    torch.testing.assert_close(hidden, reference[2], rtol=1e-5, atol=1e-5)


def test_block_zero_is_not_a_sequential_step(setup, chain, capsys):
    root, model_dir, shared, _, _ = setup
    code = calibrate_block.main(["--model-dir", str(model_dir), "--calibration-dir", str(shared), "--block", "0",
                                 "--previous-layers-dir", str(chain), "--output-dir", str(root / "bad"),
                                 "--inputs-output", str(root / "bad.safetensors"), "--quiet"])
    assert code == 2 and "block 0" in capsys.readouterr().err and not (root / "bad").exists()


def test_finetune_lowers_the_block_output_error(setup, chain):
    root, model_dir, _, windows, _ = setup
    model = load_causal_lm(model_dir)
    prefix, blocks = find_decoder_blocks(model)
    block = blocks[1]
    call = block_call_inputs(model, windows, 1)
    hidden_in = load_hidden_states(root / "block1.inputs.safetensors", windows)
    with torch.no_grad():
        targets = block_forward(block, call, hidden_in)
    quantized = {}
    for name in find_linears(block):
        t = load_file(str(chain / f"{prefix}.1.{name}.safetensors"))
        quantized[name] = QuantizedLinearParams(unpack_codes(t["codes"], 4), t["codebooks"], t["scales"])
    result = finetune_block(block, call, hidden_in, targets, quantized,
                            BlockFinetuneSettings(epochs=4, lr=1e-3, batch_size=2), progress=False)
    assert result.relative_mse_after < 0.9 * result.relative_mse_before
    assert result.relative_mse_after == min(result.relative_mse_per_epoch)
    # recompute the error independently: the block with the tuned weights and norms installed
    with torch.no_grad():
        for name, params in result.linears.items():
            block.get_submodule(name).weight.copy_(dequantize_weight(params.codes, params.codebooks, params.scales))
            assert torch.equal(params.codes, quantized[name].codes)  # codes are fixed
        for name, tensor in result.block_tensors.items():
            block.get_parameter(name).copy_(tensor)
        out = block_forward(block, call, hidden_in)
    error = float(((out - targets) ** 2).sum() / (targets ** 2).sum())
    assert error == pytest.approx(result.relative_mse_after, rel=1e-4)
    assert "input_layernorm.weight" in result.block_tensors


def test_finetuned_block_is_what_propagates_and_what_is_stitched(setup, chain, tmp_path):
    root, model_dir, shared, windows, _ = setup
    tuned = tmp_path / "tuned1"
    settings = finetune_stage.FinetuneBlockSettings(block=1, tuning=BlockFinetuneSettings(epochs=2, lr=1e-3), quiet=True)
    paths = finetune_stage.FinetuneBlockPaths(model_dir=model_dir, calibration_dir=shared, layers_dir=chain,
                                              inputs=root / "block1.inputs.safetensors", output_dir=tuned)
    assert run_stage_module(finetune_stage, settings, paths) == 0
    report = json.loads((tuned / "finetune.json").read_text())
    assert report["relative_mse_after"] < report["relative_mse_before"]
    calibrate_next(model_dir, shared, tmp_path, tuned, 2, previous_block_tensors=tuned / "block.safetensors",
                   previous_inputs=root / "block1.inputs.safetensors")
    # reference: the model with block 0 quantized and block 1 quantized and tuned (norms included)
    model = dequantized_model(model_dir, chain, [0])
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.startswith("model.layers.1.") and isinstance(module, torch.nn.Linear):
                t = load_file(str(tuned / f"{name}.safetensors"))
                module.weight.copy_(dequantize_weight(unpack_codes(t["codes"], 4), t["codebooks"], t["scales"]))
        for key, tensor in load_file(str(tuned / "block.safetensors")).items():
            model.get_parameter(key).copy_(tensor)
        reference = model(input_ids=windows, output_hidden_states=True, use_cache=False).hidden_states[2]
    torch.testing.assert_close(load_hidden_states(tmp_path / "block2.inputs.safetensors"), reference,
                               rtol=1e-5, atol=1e-5)
    stitched = tmp_path / "stitched"
    blocks_dir = tmp_path / "others"
    blocks_dir.mkdir()
    for path in chain.glob("model.layers.[02].*.safetensors*"):  # with their checksum records
        (blocks_dir / path.name).symlink_to(path)
    quantize_block(model_dir, tmp_path / "block2", blocks_dir, 2)
    replaced = load_file(str(tuned / "block.safetensors"))
    write_aqlm_checkpoint(model_dir, [blocks_dir, tuned], stitched, num_codebooks=1, nbits=4, dtype="float32",
                          replaced_tensors=replaced)
    stored = load_file(str(stitched / "model.safetensors"))
    for key, tensor in replaced.items():
        assert torch.equal(stored[key], tensor)
    tuned_layer = load_file(str(tuned / "model.layers.1.mlp.down_proj.safetensors"))
    assert torch.equal(stored["model.layers.1.mlp.down_proj.codebooks"], tuned_layer["codebooks"])


def test_cast_floats_reaches_every_block_argument(setup):
    from aqflow.calibration.block_finetune import cast_floats

    _, model_dir, _, windows, _ = setup
    call = block_call_inputs(load_causal_lm(model_dir), windows, 1)
    cast = cast_floats(call, torch.bfloat16)
    cos, sin = cast.kwargs["position_embeddings"]
    assert cast.hidden_states.dtype == cos.dtype == sin.dtype == torch.bfloat16
    for key, value in call.kwargs.items():  # integer tensors (positions) keep their dtype
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            assert cast.kwargs[key].dtype == value.dtype
