"""The V-step's optimiser: Adam without a first moment when its beta1 is 0 (the recipe's).

With beta1 = 0 Adam's first moment is the current gradient (m = 0 * m + 1 * g, and its bias
correction 1 - 0^t is 1), so storing it only doubles the gradient. For the V-step that copy is a
float32 tensor the size of every quantized weight: 28 GB at Llama-3.1-8B, the difference between
PV-tuning fitting on one 141 GB card or not. `SecondMomentAdam` keeps only the second moment and
takes the same steps as torch.optim.Adam(betas=(0, beta2)); any other beta1 gets torch's Adam.
"""

from __future__ import annotations

import math

import torch


def adam_update_(parameter: torch.Tensor, gradient: torch.Tensor, state: dict, lr: float, beta1: float, beta2: float,
                 eps: float) -> None:
    """One Adam step of `parameter` (any shape) in place, torch.optim.Adam's arithmetic; `state`
    holds "step" (float32 scalar, on the host), "exp_avg_sq" and, where beta1 is not 0,
    "exp_avg" (both in the parameter's shape), created on the first step. At beta1 0 the first
    moment is the gradient itself and is not kept."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        if beta1 != 0.0:
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
    if beta1 == 0.0:
        state.pop("exp_avg", None)  # resumed from torch's Adam: at beta1 0 it is the last gradient, unused
    state["step"] += 1
    step = float(state["step"])
    second = state["exp_avg_sq"]
    second.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
    # one layer's temporary at a time: the denominator is never held for all layers
    denominator = second.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
    if beta1 == 0.0:
        parameter.addcdiv_(gradient, denominator, value=-lr)
        return
    first = state["exp_avg"]
    first.lerp_(gradient, 1 - beta1)
    parameter.addcdiv_(first, denominator, value=-lr / (1 - beta1**step))


class SecondMomentAdam(torch.optim.Optimizer):
    """Adam with beta1 = 0 and no stored first moment: per parameter p [any shape] with gradient g,
    v = beta2 v + (1 - beta2) g², p -= lr g / (sqrt(v / (1 - beta2^t)) + eps). State per parameter:
    "step" (float32 scalar) and "exp_avg_sq" (p's shape and dtype)."""

    def __init__(self, params, lr: float = 1e-3, beta2: float = 0.999, eps: float = 1e-8):
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must lie in [0, 1), got {beta2}")
        # torch.optim.Adam's names, so the state of a run saved by torch's Adam at beta1 0 resumes here
        super().__init__(params, dict(lr=lr, betas=(0.0, beta2), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta2, lr, eps = group["betas"][1], group["lr"], group["eps"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                adam_update_(parameter, parameter.grad, self.state[parameter], lr, 0.0, beta2, eps)
        return loss


def v_step_optimizer(groups: list[dict], beta1: float, beta2: float) -> torch.optim.Optimizer:
    """The V-step's Adam over parameter `groups` (each with its "lr"): `SecondMomentAdam` when
    beta1 is 0, torch.optim.Adam otherwise."""
    if beta1 == 0.0:
        return SecondMomentAdam(groups, beta2=beta2)
    return torch.optim.Adam(groups, betas=(beta1, beta2))


def state_bytes_per_parameter_byte(optimizer_beta1: float) -> int:
    """Moments an Adam keeps per parameter, in units of the parameter's own bytes (2, or 1 for
    `SecondMomentAdam`)."""
    return 1 if optimizer_beta1 == 0.0 else 2
