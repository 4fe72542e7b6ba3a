"""The continuous half of an epoch: Adam on codebooks and scales with the codes fixed.

Loss: L = tr(ΔW XᵀX ΔWᵀ) / tr(W XᵀX Wᵀ), ΔW = W - Ŵ, Ŵ[o, j] = s_o Σ_m C[m, codes[o, j, m]].
Its gradients are closed-form, so no autograd graph is needed (and the phase can be captured
as one CUDA graph):

    dL/dŴ        = -2 ΔW XᵀX / tr(W XᵀX Wᵀ)                        [out, in] -> Γ [out, G, g]
    dL/dC[m, k]  = Σ_{(o, j): codes[o, j, m] = k} s_o Γ[o, j]        (an index_add)
    dL/ds_o      = Σ_j Γ[o, j] · Σ_m C[m, codes[o, j, m]]

The optimiser is AQLM's: Adam with β1 = 0, β2 = 0.95 and AMSGrad, its state kept across epochs.

The product ΔW·XᵀX is the whole cost of a step at large shapes (8 ms of 10 for a 3072x8192 layer
on an H100 in full fp32). On CUDA it runs in TF32 by default (`matmul_precision="high"`): the
gradient is then ~1e-3 relative off, which Adam's normalised steps absorb, and the quantizer
measures the objective in full fp32 after the phase and rolls a phase that made it worse back.
"""

from __future__ import annotations

import contextlib

import torch

from aqflow.quant.cuda_graphs import capture_graph
from aqflow.quant.gather_kernels import codeword_sums
from aqflow.quant.objective import output_error


def codeword_index(codes: torch.Tensor, num_codewords: int) -> torch.Tensor:
    """Row of each (group, codebook) code in the flattened [M*K, g] codebooks. codes [out, G, M] -> [out*G*M]"""
    return (codes + torch.arange(codes.shape[-1], device=codes.device) * num_codewords).reshape(-1)


def objective_gradients(
    weight: torch.Tensor,
    xtx: torch.Tensor,
    codes: torch.Tensor,
    codebooks: torch.Tensor,
    scales: torch.Tensor,
    reference_error: torch.Tensor,
    flat_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the relative output error. flat_index: `codeword_index(codes, K)`, if at hand.

    weight [out, in], xtx [in, in], codes [out, G, M], codebooks [M, K, g], scales [out], reference_error scalar
    -> (d/dcodebooks [M, K, g], d/dscales [out])
    """
    num_rows, num_groups, num_codebooks = codes.shape
    _, num_codewords, group_size = codebooks.shape
    sums = codeword_sums(codes, codebooks)  # [out, G, g]
    delta = weight - (sums * scales[:, None, None]).reshape(num_rows, -1)
    grad_weight = ((delta @ xtx) * (-2 / reference_error)).view(num_rows, num_groups, group_size)
    grad_scales = (grad_weight * sums).sum(dim=(1, 2))
    if flat_index is None:
        flat_index = codeword_index(codes, num_codewords)  # [out*G*M]
    per_code = (grad_weight * scales[:, None, None])[:, :, None, :].expand(num_rows, num_groups, num_codebooks, group_size)
    grad_codebooks = torch.zeros(num_codebooks * num_codewords, group_size, dtype=codebooks.dtype, device=codebooks.device)
    grad_codebooks.index_add_(0, flat_index, per_code.reshape(-1, group_size))
    return grad_codebooks.view_as(codebooks), grad_scales


class Amsgrad:
    """Adam with AMSGrad for a list of tensors, updated with foreach kernels (few launches per
    step). The step count lives on the device, so a captured graph stays correct when replayed
    in later epochs."""

    def __init__(self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float):
        self.params = params
        self.lr, self.betas, self.eps = lr, betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.max_exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.step = torch.zeros((), dtype=params[0].dtype, device=params[0].device)

    def reset_(self) -> None:
        for state in (self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq):
            torch._foreach_zero_(state)
        self.step.zero_()

    def update_(self, grads: list[torch.Tensor]) -> None:
        beta1, beta2 = self.betas
        self.step.add_(1)
        torch._foreach_lerp_(self.exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(self.exp_avg_sq, beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, value=1 - beta2)
        torch._foreach_maximum_(self.max_exp_avg_sq, self.exp_avg_sq)
        # param -= lr / (1 - beta1^t) * m / (sqrt(vmax) / sqrt(1 - beta2^t) + eps)
        denom = torch._foreach_sqrt(self.max_exp_avg_sq)
        torch._foreach_div_(denom, (1 - beta2**self.step).sqrt())
        torch._foreach_add_(denom, self.eps)
        torch._foreach_mul_(denom, (1 - beta1**self.step) / -self.lr)
        torch._foreach_addcdiv_(self.params, self.exp_avg, denom)


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """torch.set_float32_matmul_precision inside the block only ("highest": fp32; "high": TF32)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# Captured Adam phases, shared by layers of the same shapes (see beam_search._GRAPH_CACHE).
_GRAPH_CACHE: dict[tuple, "CodebookAdam"] = {}


class CodebookAdam:
    """Codebooks and scales of one layer with their optimiser state, updated in place.

    weight [out, in], xtx [in, in], codebooks [M, K, g], scales [out]
    """

    def __init__(
        self,
        weight: torch.Tensor,
        xtx: torch.Tensor,
        codebooks: torch.Tensor,
        scales: torch.Tensor,
        lr: float,
        betas: tuple[float, float] = (0.0, 0.95),
        eps: float = 1e-8,
        matmul_precision: str = "high",
    ):
        self.weight, self.xtx = weight.clone(), xtx.clone()
        # only CUDA: on a CPU "high" may pick reduced-precision paths that buy nothing here
        self.matmul_precision = matmul_precision if weight.is_cuda else "highest"
        self.codebooks, self.scales = codebooks.clone(), scales.clone()
        self.reference_error = output_error(weight, xtx)
        self.optimizer = Amsgrad([self.codebooks, self.scales], lr, betas, eps)
        self.graph = None
        self.static_codes = None

    @classmethod
    def for_layer(cls, weight, xtx, codebooks, scales, lr, use_graphs: bool = True, matmul_precision: str = "high") -> "CodebookAdam":
        """A fresh optimiser for this layer; on CUDA with graphs, reuses the buffers (and captured
        phases) of an earlier layer of the same shapes, loaded with this layer's tensors."""
        if not (use_graphs and weight.is_cuda):
            return cls(weight, xtx, codebooks, scales, lr, matmul_precision=matmul_precision)
        key = (tuple(weight.shape), tuple(codebooks.shape), weight.dtype, weight.device, lr, matmul_precision)
        if key not in _GRAPH_CACHE:
            _GRAPH_CACHE[key] = cls(weight, xtx, codebooks, scales, lr, matmul_precision=matmul_precision)
            _GRAPH_CACHE[key].graph = {}
        cached = _GRAPH_CACHE[key]
        for buffer, value in ((cached.weight, weight), (cached.xtx, xtx), (cached.codebooks, codebooks), (cached.scales, scales)):
            buffer.copy_(value)
        cached.reference_error.copy_(output_error(weight, xtx))
        cached.optimizer.reset_()
        return cached

    def _steps_(self, codes: torch.Tensor, steps: int) -> None:
        flat_index = codeword_index(codes, self.codebooks.shape[1])  # codes are fixed for the phase
        with float32_matmul_precision(self.matmul_precision):
            for _ in range(steps):
                grads = objective_gradients(self.weight, self.xtx, codes, self.codebooks, self.scales, self.reference_error, flat_index)
                self.optimizer.update_(list(grads))

    def run(self, codes: torch.Tensor, steps: int) -> None:
        """`steps` Adam steps with `codes` fixed. codes [out, G, M]"""
        if self.graph is None:
            self._steps_(codes, steps)
            return
        if self.static_codes is None:
            self.static_codes = codes.clone()
        if steps not in self.graph:
            self.graph[steps] = self._capture(steps)
        self.static_codes.copy_(codes)
        self.graph[steps].replay()

    def _capture(self, steps: int) -> torch.cuda.CUDAGraph:
        # the warm-up runs on scratch copies: the real parameters and optimiser state must not move
        scratch = CodebookAdam(
            self.weight, self.xtx, self.codebooks, self.scales, self.optimizer.lr, self.optimizer.betas, self.optimizer.eps, self.matmul_precision
        )
        graph, _ = capture_graph(lambda: self._steps_(self.static_codes, steps), lambda: scratch._steps_(self.static_codes, 1))
        return graph
