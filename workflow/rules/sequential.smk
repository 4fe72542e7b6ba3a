# Input functions of the block-wise modes (calibration.propagation: sequential, block fine-tuning):
# the per-variant calibration of blocks >= 1, the block inputs they pass on, the tuned blocks that
# stitch and the evaluations read, and the layers' own XᵀX folder in either mode.
from aqflow.models.folder import block_index


def block_layer_artifacts(wildcards, block):
    layers = zip(quantized_layers(wildcards), layer_artifacts(wildcards))
    return [path for layer, path in layers if block_index(layer) == block]


def layer_calibration_dir(wildcards):
    """The XᵀX of a layer's block: shared (fp mode, and block 0 in sequential mode) or, for a block
    after the first in sequential mode, the variant's own (it depends on its quantized blocks).
    """
    block = block_index(wildcards.layer)
    if PLAN.sequential and block > 0:
        pattern = rules.calibrate_block.output.calibration
        return variant_output(pattern, wildcards, block=block)
    return calibration_dir(wildcards)


def tuned_block_dir(wildcards, block):
    return variant_output(rules.finetune_block.output[0], wildcards, block=block)


def block_inputs_path(wildcards, block):
    """Inputs of `block` in the quantized model (a temporary artifact of its calibrate_block job)."""
    return variant_output(rules.calibrate_block.output.inputs, wildcards, block=block)


# block inputs are removed once used (temp), unless kept: a missing one is no lost result
BLOCK_INPUTS_TEMPORARY = not PLAN.calibration.get("keep_block_inputs", False)


def block_inputs_output(path):
    """Block inputs are removed once used (temp), unless calibration.keep_block_inputs: kept, a
    later rerun of block i starts from block i-1's stored inputs instead of recomputing from block 1.
    """
    return temp(path) if BLOCK_INPUTS_TEMPORARY else path


def previous_block_layers(wildcards):
    """What calibrate_block of block i runs: block i-1 as quantized (and tuned, if enabled)."""
    previous = int(wildcards.block) - 1
    if PLAN.finetune:
        return [tuned_block_dir(wildcards, previous)]
    return block_layer_artifacts(wildcards, previous)


def previous_layers_dir(wildcards):
    if PLAN.finetune:
        return tuned_block_dir(wildcards, int(wildcards.block) - 1)
    return f"{PLAN.variant_folder(wildcards)}/layers"


def previous_block_tensors(wildcards):
    previous = int(wildcards.block) - 1
    return (
        f"{tuned_block_dir(wildcards, previous)}/block.safetensors"
        if PLAN.finetune
        else ""
    )


def previous_block_inputs(wildcards):
    previous = int(wildcards.block) - 1
    return [block_inputs_path(wildcards, previous)] if previous >= 1 else []


def block_layers(wildcards):
    return block_layer_artifacts(wildcards, int(wildcards.block))


def finetune_inputs(wildcards):
    """The inputs of the block being tuned; block 0's are the embeddings, recomputed."""
    block = int(wildcards.block)
    return [block_inputs_path(wildcards, block)] if block >= 1 else []


def layers_dir(wildcards):
    return f"{PLAN.variant_folder(wildcards)}/layers"


def finetuned_blocks(wildcards):
    """Every tuned block folder of a variant (none unless block fine-tuning is enabled)."""
    if not PLAN.finetune:
        return []
    return [tuned_block_dir(wildcards, block) for block in range(num_blocks(wildcards))]


def stitch_layers_dirs(wildcards):
    """Where stitch finds the layers: the tuned block folders, or the variant's layers folder."""
    return finetuned_blocks(wildcards) or [layers_dir(wildcards)]


def replaced_block_tensors(wildcards):
    return [f"{folder}/block.safetensors" for folder in finetuned_blocks(wildcards)]
