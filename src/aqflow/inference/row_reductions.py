"""One-pass row reductions in a compiled batch-1 decode step: each RMSNorm reads its row once.

Why: at batch 1 every RMSNorm of the step is a reduction over one row of the hidden size (3,072 for
Llama-3.2-3B, 4,096 for Llama-3.1-8B), fused by torch.compile with what comes before it (the residual add,
a 2-bit GEMV's open sums finished). Inductor keeps a reduction in registers whole ("persistent") only up to
1,024 values; a longer one becomes a loop over blocks, and RMSNorm's two loops (the sum of squares, then the
scaled output, each reading its inputs again from L2), so a kernel that needs one trip to memory makes
several in a row. Two such kernels a layer sit on the step's critical path in both the bf16 and the 2-bit
model.

`one_pass_rows(enabled)`: a context in which what torch.compile compiles (in this thread) keeps a reduction
of a single row whole in registers up to ROW_LIMIT values; other reductions are decided as inductor decides
them. The compiled step's results are the same reductions in another order (float rounding).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

ROW_LIMIT = 8192  # values of one row reduced in one pass (hidden sizes up to 8,192); larger rows loop as before

_state = {"active": False}


def active() -> bool:
    """Whether what is compiled now reduces single rows in one pass (inside `one_pass_rows(True)`)."""
    return _state["active"]


def keeps_row_whole(sizes, numel, reduction_numel, limit: int = ROW_LIMIT) -> bool:
    """Whether a reduction of numel outputs over reduction_numel values each (sympy expressions; `sizes` an
    inductor SizeVarAllocator) is one row of at most `limit` values, known so at compile time."""
    return sizes.statically_known_equals(numel, 1) and sizes.statically_known_leq(reduction_numel, limit)


def _one_pass_choices_class():
    """An InductorChoices subclass (torch imported where used) that keeps one-row reductions persistent."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    class OnePassRowChoices(InductorChoices):
        def should_use_persistent_reduction(self, features, cooperative_reduction) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if not config.triton.persistent_reductions or cooperative_reduction:
                return False
            try:
                return keeps_row_whole(V.graph.sizevars, features.numel, features.reduction_numel)
            except (AttributeError, TypeError):  # another torch's inductor: its own decision stands
                return False

        def uuid(self) -> str:  # in the compile caches' keys, so no cache serves a step compiled otherwise
            return f"aqflow-one-pass-rows-{ROW_LIMIT}"

    return OnePassRowChoices


def _cache_patch(choices_class) -> dict:
    """Inductor settings that keep its caches honest: the choices class in their keys where this torch keys
    on it, else no cache for what is compiled in the context."""
    from torch._inductor import config

    if hasattr(config, "inductor_choices_class") and \
            "inductor_choices_class" in getattr(config, "_cache_config_factory_keys", ()):
        return {"inductor_choices_class": choices_class}
    return {"fx_graph_cache": False}


@contextlib.contextmanager
def one_pass_rows(enabled: bool = True) -> Iterator[bool]:
    """Within the block torch.compile (in this thread) reduces single rows of up to ROW_LIMIT values in one
    pass; yields whether it does (False where not enabled or this torch has no InductorChoices to replace)."""
    if not enabled:
        yield False
        return
    try:
        choices_class = _one_pass_choices_class()
    except ImportError:  # a torch without inductor's choices: its reductions as they are
        yield False
        return
    from torch._inductor import config
    from torch._inductor.virtualized import V

    previous = _state["active"]
    _state["active"] = True
    try:
        with config.patch(_cache_patch(choices_class)), V.set_choices_handler(choices_class()):
            yield True
    finally:
        _state["active"] = previous
