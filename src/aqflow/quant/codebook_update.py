"""The continuous half of an epoch: Adam on codebooks and scales with the codes fixed.

Loss: L = tr(ΔW XᵀX ΔWᵀ) / tr(W XᵀX Wᵀ), ΔW = W - Ŵ, Ŵ[o, j] = s_o Σ_m C[m, codes[o, j, m]].
Its gradients are closed-form, so no autograd graph is needed (and the phase can be captured
as one CUDA graph):

    dL/dŴ        = -2 ΔW XᵀX / tr(W XᵀX Wᵀ)                        [out, in] -> Γ [out, G, g]
    dL/dC[m, k]  = Σ_{(o, j): codes[o, j, m] = k} s_o Γ[o, j]        (an index_add)
    dL/ds_o      = Σ_j Γ[o, j] · Σ_m C[m, codes[o, j, m]]

The optimiser is AQLM's: Adam with β1 = 0, β2 = 0.95 and AMSGrad, its state kept across epochs.
"""

from __future__ import annotations

import torch

from aqflow.quant.objective import output_error
from aqflow.quant.representation import group_reconstruction


def objective_gradients(
    weight: torch.Tensor, xtx: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor, reference_error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the relative output error.

    weight [out, in], xtx [in, in], codes [out, G, M], codebooks [M, K, g], scales [out], reference_error scalar
    -> (d/dcodebooks [M, K, g], d/dscales [out])
    """
    num_rows, num_groups, num_codebooks = codes.shape
    _, num_codewords, group_size = codebooks.shape
    sums = group_reconstruction(codes, codebooks)  # [out, G, g]
    delta = weight - (sums * scales[:, None, None]).reshape(num_rows, -1)
    grad_weight = ((delta @ xtx) * (-2 / reference_error)).view(num_rows, num_groups, group_size)
    grad_scales = (grad_weight * sums).sum(dim=(1, 2))
    flat_index = (codes + torch.arange(num_codebooks, device=codes.device) * num_codewords).reshape(-1)  # [out*G*M]
    per_code = (grad_weight * scales[:, None, None])[:, :, None, :].expand(num_rows, num_groups, num_codebooks, group_size)
    grad_codebooks = torch.zeros(num_codebooks * num_codewords, group_size, dtype=codebooks.dtype, device=codebooks.device)
    grad_codebooks.index_add_(0, flat_index, per_code.reshape(-1, group_size))
    return grad_codebooks.view_as(codebooks), grad_scales


class AmsgradState:
    """Adam/AMSGrad moments for one tensor; the step count lives on the device so a captured
    graph stays correct when replayed in later epochs."""

    def __init__(self, like: torch.Tensor, step: torch.Tensor):
        self.exp_avg = torch.zeros_like(like)
        self.exp_avg_sq = torch.zeros_like(like)
        self.max_exp_avg_sq = torch.zeros_like(like)
        self.step = step

    def update_(self, param: torch.Tensor, grad: torch.Tensor, lr: float, betas: tuple[float, float], eps: float) -> None:
        beta1, beta2 = betas
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.maximum(self.max_exp_avg_sq, self.exp_avg_sq, out=self.max_exp_avg_sq)
        bias1 = 1 - beta1**self.step
        bias2 = 1 - beta2**self.step
        denom = self.max_exp_avg_sq.sqrt() / bias2.sqrt() + eps
        param.addcdiv_(self.exp_avg, denom * bias1, value=-lr)


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
        use_graphs: bool = True,
    ):
        self.weight, self.xtx = weight, xtx
        self.codebooks, self.scales = codebooks.clone(), scales.clone()
        self.lr, self.betas, self.eps = lr, betas, eps
        self.reference_error = output_error(weight, xtx)
        self.step = torch.zeros((), dtype=weight.dtype, device=weight.device)
        self.states = (AmsgradState(self.codebooks, self.step), AmsgradState(self.scales, self.step))
        self.use_graphs = use_graphs and weight.is_cuda
        self._graph = None

    def _steps_(self, codes: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            grads = objective_gradients(self.weight, self.xtx, codes, self.codebooks, self.scales, self.reference_error)
            self.step.add_(1)
            for param, grad, state in zip((self.codebooks, self.scales), grads, self.states):
                state.update_(param, grad, self.lr, self.betas, self.eps)

    def run(self, codes: torch.Tensor, steps: int) -> None:
        """`steps` Adam steps with `codes` fixed. codes [out, G, M]"""
        if not self.use_graphs:
            self._steps_(codes, steps)
            return
        if self._graph is None or self._graph[1] != steps:
            self._graph = (self._capture(codes, steps), steps)
        self._static_codes.copy_(codes)
        self._graph[0].replay()

    def _capture(self, codes: torch.Tensor, steps: int) -> torch.cuda.CUDAGraph:
        self._static_codes = codes.clone()
        scratch = CodebookAdam(self.weight, self.xtx, self.codebooks, self.scales, self.lr, self.betas, self.eps, use_graphs=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on scratch copies: the real state must not move
            scratch._steps_(self._static_codes, 1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._steps_(self._static_codes, steps)
        return graph
