"""The V-step's state in host memory, streamed through the card one layer at a time, and the
P-step's Adam moments beside it (`HostMomentsAdam`).

The straight-through weights and their Adam moments (8-12 of the 12-16 bytes per quantized
weight, `memory.state_bytes`) are read and written once per optimiser step: by Adam and by the
V-step that follows it. On a card too small for all of it (an 8B model on an 80 GB card) they
live in pinned host memory instead; only the gradient dL/dW, which every micro-batch adds to,
stays on the card (`PVLinear.device_gradient`). Each step then takes every layer in turn: its
rows and moments copied in (the next layer's copy overlapping this layer's work), Adam and the
V-step on the card, copied back.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .vstep import DEFAULT_MEMORY_BUDGET_BYTES, v_step_layer_queued
from .vstep_adam import adam_update_


def move_straight_through_to_host(layers) -> None:
    """Put each layer's straight-through weight in pinned host memory (where the card has one)
    and give the layer a zero gradient buffer of its shape on the card."""
    for layer in layers:
        weight = layer.straight_through
        device = layer.codes.device
        host = weight.detach().to("cpu")
        if device.type == "cuda":
            host = host.pin_memory()
        layer.straight_through = torch.nn.Parameter(host, requires_grad=False)
        layer.device_gradient = torch.zeros(weight.shape, dtype=weight.dtype, device=device)


class HostVStep(torch.optim.Optimizer):
    """Adam on host-resident straight-through weights, each followed by its layer's V-step.

    params: the layers' straight-through weights [rows, in] float32 in host memory, one group per
    layer (with its "lr"); layers: the PVLinear of each, in the same order, whose
    `device_gradient` [rows, in] float32 holds dL/dW. `step()` returns the number of code groups
    changed. State per weight as torch.optim.Adam names it ("step", "exp_avg_sq", "exp_avg" where
    beta1 is not 0), in host memory: a saved state resumes with either optimiser.
    """

    def __init__(self, groups: list[dict], layers, beta1: float, beta2: float, max_fraction: float, beam_size: int,
                 memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, eps: float = 1e-8):
        super().__init__(groups, dict(betas=(beta1, beta2), eps=eps))
        self.layers = list(layers)
        self.v_step_settings = (max_fraction, beam_size, memory_budget_bytes)

    def _to_device(self, index: int, stream) -> tuple[torch.Tensor, dict]:
        """Layer `index`'s straight-through weight and moments, copied to its device on `stream`."""
        layer = self.layers[index]
        device = layer.codes.device
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            weight = layer.straight_through.detach().to(device, non_blocking=True)
            moments = {key: value.to(device, non_blocking=True) if key != "step" else value
                       for key, value in self.state[layer.straight_through].items()}
        return weight, moments

    def _to_host(self, layer, weight: torch.Tensor, moments: dict, stream) -> None:
        """Copy a layer's updated weight and moments back into its host tensors on `stream`."""
        parameter = layer.straight_through
        state = self.state[parameter]
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            parameter.copy_(weight, non_blocking=True)
            for key, value in moments.items():
                if key == "step":
                    state["step"] = value
                    continue
                if key not in state:  # the first step made the moments on the device
                    state[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=stream is not None)
                state[key].copy_(value, non_blocking=True)

    @torch.no_grad()
    def step(self, closure=None) -> int:
        """Adam and the V-step of every layer, streamed: layer i + 1's copy in, layer i's work and
        layer i - 1's copy out overlap (three streams); returns the code groups changed."""
        if closure is not None:
            raise ValueError("HostVStep takes no closure")
        if not self.layers:
            return 0
        device = self.layers[0].codes.device
        cuda = device.type == "cuda"
        compute = torch.cuda.current_stream(device) if cuda else None
        inward, outward = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        changed = torch.zeros((), dtype=torch.int64, device=device)
        ahead = self._to_device(0, inward)
        ready = inward.record_event() if cuda else None
        for index, (group, layer) in enumerate(zip(self.param_groups, self.layers)):
            if cuda:
                compute.wait_event(ready)
            weight, moments = ahead
            if index + 1 < len(self.layers):
                ahead = self._to_device(index + 1, inward)
                ready = inward.record_event() if cuda else None
            beta1, beta2 = group["betas"]
            adam_update_(weight, layer.device_gradient, moments, group["lr"], beta1, beta2, group["eps"])
            changed += v_step_layer_queued(layer, *self.v_step_settings, straight_through=weight)
            layer.device_gradient.zero_()
            if cuda:
                outward.wait_event(compute.record_event())
                # made on other streams than the ones that read them last: not reused before those finish
                for value in (weight, *(v for k, v in moments.items() if k != "step")):
                    value.record_stream(compute)
                    value.record_stream(outward)
            self._to_host(layer, weight, moments, outward)
        if cuda:
            outward.synchronize()  # the host tensors are whole before anyone reads them
        return int(changed)


class HostMomentsAdam(torch.optim.Optimizer):
    """torch.optim.Adam on parameters on the card whose two moments live in pinned host memory.

    With the V-step's state on the host, the P-step's Adam moments of the non-quantized parameters
    (8 bytes per weight: 7.8 GiB at Llama-3.1-8B, embeddings and head) are the largest part of the
    card's state that is touched once a step. `step()` takes the parameters in turn: the moments
    copied in, torch's own Adam step on the card (`fused` as given: the same arithmetic as keeping
    them there), copied back. State per parameter as torch.optim.Adam names it, moments on the host.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float = 1e-8, fused: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostMomentsAdam takes no closure")
        cuda = False
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                cuda = cuda or parameter.device.type == "cuda"
                adam = torch.optim.Adam([parameter], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                        fused=self.fused)
                kept = self.state[parameter]
                if kept:
                    adam.state[parameter] = {key: value if key == "step" else value.to(parameter.device, non_blocking=True)
                                             for key, value in kept.items()}
                adam.step()
                self._keep_on_host(parameter, adam.state[parameter])
        if cuda:
            torch.cuda.current_stream().synchronize()  # the host moments are whole before anyone reads them

    def _keep_on_host(self, parameter: torch.Tensor, state: dict) -> None:
        """Copy `state`'s moments into this parameter's host tensors (made, pinned, where absent)."""
        kept = self.state[parameter]
        for key, value in state.items():
            if key == "step" or value.device.type == "cpu":  # the step counter, or a CPU run's moments
                kept[key] = value
                continue
            host = kept.get(key)
            if host is None or host.device.type != "cpu":
                host = kept[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading (which puts the moments beside their parameters), then back to the host."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for parameter in group["params"]:
                if self.state[parameter]:
                    self._keep_on_host(parameter, dict(self.state[parameter]))
        if any(p.device.type == "cuda" for group in self.param_groups for p in group["params"]):
            torch.cuda.current_stream().synchronize()
