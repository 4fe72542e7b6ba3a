"""Evaluation: perplexity (zero-shot tasks come later)."""

from .perplexity import perplexity, window_nll

__all__ = ["perplexity", "window_nll"]
