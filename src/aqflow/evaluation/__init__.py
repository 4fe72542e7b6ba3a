"""Evaluation: perplexity by the GPTQ/AQLM protocol, zero-shot tasks through lm-eval."""

from .perplexity import perplexity, window_nll
from .protocol import SampledWindows, c4_windows, wikitext2_windows, windows_sha256
from .zero_shot import HEADLINE_METRIC, average_accuracy, run_zero_shot, write_task_configs

__all__ = [
    "HEADLINE_METRIC", "SampledWindows", "average_accuracy", "c4_windows", "perplexity", "run_zero_shot",
    "wikitext2_windows", "window_nll", "windows_sha256", "write_task_configs",
]
