"""Capturing a phase of the quantizer as a CUDA graph (the pattern every phase shares).

The phases (a beam-search pass, an Adam phase, a block of Lloyd iterations, an OA-EM M-step) are
thousands of small kernels whose launch cost exceeds their work; each is captured once per shape
over static buffers and replayed. Capture needs a warm-up run on a side stream first (cuBLAS
handles, Triton compilation, allocator pools), on scratch copies when the phase updates state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture_graph(run: Callable[[], Any], warm_up: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Call `warm_up()` on a side stream, then capture `run()`. -> (graph, what `run` returned)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm_up()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph, output
