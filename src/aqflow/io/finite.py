"""NaN or Inf metrics are errors, never numbers in a results file.

A model computed in a dtype whose range it overflows (Gemma 3 in float16) gives NaN perplexity;
a diverged optimisation gives an Inf loss. Every stage that writes a metric passes it through
`require_finite` first, which names the stage, the model and each bad metric.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

# standard errors are undefined (NaN) for a single example, by definition rather than by fault
UNDEFINED_ALLOWED_SUFFIXES = ("_stderr",)


class NonFiniteMetricError(ValueError):
    """A metric is NaN or infinite; the message names the stage, the model and the metric."""


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}[{index}]")
    else:
        yield path, value


def non_finite_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """{dotted name: value} of every float leaf of `metrics` that is NaN or +-Inf (nested dicts
    and lists are walked; standard errors are exempt)."""
    return {name: value for name, value in _leaves(metrics, "")
            if isinstance(value, float) and not math.isfinite(value)
            and not name.endswith(UNDEFINED_ALLOWED_SUFFIXES)}


def require_finite(metrics: Mapping[str, Any], stage: str, model: str) -> None:
    """Raise NonFiniteMetricError if any metric is NaN or Inf."""
    bad = non_finite_metrics(metrics)
    if bad:
        listed = ", ".join(f"{name} = {value}" for name, value in bad.items())
        raise NonFiniteMetricError(
            f"{stage}: model {model}: non-finite metrics ({listed}); nothing was written. A model computed in a "
            "dtype whose range it overflows gives NaN (e.g. a bfloat16 model in float16): set its `dtype` in config.yaml")
