"""Regional compilation for PV-tuning: each decoder block of the teacher and of the student run
through torch.compile (TorchInductor), the quantized linears left outside the graphs.

In eager mode a Llama block runs its RMS norms, rotary embeddings, SiLU gate and residual adds
as a dozen separate elementwise kernels, each a pass over the [B, T, d] activations (float32 in
the student's residual stream); the compiled block fuses them between the matmuls. The blocks
of a model share one compiled graph (their parameters are graph inputs), so compilation happens
once per model, grad mode and window shape, not once per block.

The quantized linears (`student.PVLinear`) are not traced: their forward reads a weight kept
between micro-batches and their backward adds dL/dW into a float32 buffer, side effects a graph
cannot hold. `PVLinear.forward` is excluded with `torch.compiler.disable`, so the student's
blocks compile into the pieces between their linears, which is where the elementwise work is.

The KL's elementwise work on each chunk of logits (casts, two log-softmaxes, the KL sum and its
gradient q - p: [chunk, vocab] float32, a dozen passes over 0.5 GB at a 128k vocabulary) is
compiled too (`kl_kernel`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.structure import find_decoder_blocks
from .loss import chunk_kl_and_logit_gradient

CHOICES = ("auto", "always", "never")
BACKEND = "inductor"  # tests swap in "aot_eager" (the same graphs and autograd, no code generation)
# Recompilations a block's graph may take before dynamo falls back to eager for it: two models,
# training and evaluation, grad mode on and off, the probe's and the held-out pass's window counts
RECOMPILE_LIMIT = 32


def compiling(choice: str, device: torch.device, processes: int) -> bool:
    """Whether the loop compiles its blocks: `choice` "always" / "never"; "auto" on a CUDA card in
    one process (on a CPU the compile time outweighs what it saves at the sizes CPUs train; under
    FSDP2 the blocks are left eager)."""
    if choice not in CHOICES:
        raise ValueError(f"compile_blocks must be one of {CHOICES}, got {choice!r}")
    if choice == "auto":
        return device.type == "cuda" and processes == 1
    return choice == "always"


def decoder_block_path(model: nn.Module) -> str:
    """Qualified name of the model's list of decoder blocks, e.g. "model.layers"."""
    return find_decoder_blocks(model)[0]


def compile_blocks(model: nn.Module, blocks_path: str) -> None:
    """Compile every block of `model.get_submodule(blocks_path)` in place (`nn.Module.compile`,
    static shapes). Errors in compilation fall back to the eager block."""
    config = torch._dynamo.config
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    else:  # torch < 2.6 names it cache_size_limit
        config.cache_size_limit = max(config.cache_size_limit, RECOMPILE_LIMIT)
    config.suppress_errors = True  # an architecture inductor cannot compile still trains, eagerly
    for block in model.get_submodule(blocks_path):
        block.compile(backend=BACKEND, dynamic=False)


def uncompile_blocks(model: nn.Module, blocks_path: str) -> None:
    """Undo `compile_blocks`: the blocks run eagerly again (after training, e.g. for the checkpoint's
    own evaluation in the same process)."""
    for block in model.get_submodule(blocks_path):
        block._compiled_call_impl = None


def kl_kernel():
    """`loss.chunk_kl_and_logit_gradient` compiled (static shapes: the chunks are kl_chunk_tokens long)."""
    return torch.compile(chunk_kl_and_logit_gradient, backend=BACKEND, dynamic=False)
