"""Adam on codebooks and scales: closed-form gradients equal autograd's, the optimiser equals torch's
AMSGrad, and the phase lowers the objective."""

import torch

from aqflow.quant.codebook_update import CodebookAdam, objective_gradients
from aqflow.quant.objective import output_error, relative_output_mse
from aqflow.quant.representation import dequantize_weight
from tests.conftest import anisotropic_xtx


def _problem(rng, dtype=torch.float64):
    xtx = anisotropic_xtx(32, 256, rng).to(dtype)
    weight = torch.randn(20, 32, generator=rng, dtype=dtype)
    codes = torch.randint(0, 16, (20, 4, 2), generator=rng)
    codebooks = 0.3 * torch.randn(2, 16, 8, generator=rng, dtype=dtype)
    scales = torch.rand(20, generator=rng, dtype=dtype) + 0.5
    return weight, xtx, codes, codebooks, scales


def test_closed_form_gradients_match_autograd(rng):
    weight, xtx, codes, codebooks, scales = _problem(rng)
    c, s = codebooks.clone().requires_grad_(), scales.clone().requires_grad_()
    loss = output_error(weight - dequantize_weight(codes, c, s), xtx) / output_error(weight, xtx)
    loss.backward()
    grad_c, grad_s = objective_gradients(weight, xtx, codes, codebooks, scales, output_error(weight, xtx))
    torch.testing.assert_close(grad_c, c.grad)
    torch.testing.assert_close(grad_s, s.grad)


def test_steps_equal_torch_amsgrad(rng):
    weight, xtx, codes, codebooks, scales = _problem(rng)
    ours = CodebookAdam(weight, xtx, codebooks, scales, lr=1e-3)
    ours.run(codes, 25)
    c, s = codebooks.clone().requires_grad_(), scales.clone().requires_grad_()
    optimizer = torch.optim.Adam([c, s], lr=1e-3, betas=(0.0, 0.95), amsgrad=True)
    for _ in range(25):
        optimizer.zero_grad()
        (output_error(weight - dequantize_weight(codes, c, s), xtx) / output_error(weight, xtx)).backward()
        optimizer.step()
    torch.testing.assert_close(ours.codebooks, c.detach())
    torch.testing.assert_close(ours.scales, s.detach())


def test_phase_lowers_the_objective_and_keeps_state_across_calls(rng):
    weight, xtx, codes, codebooks, scales = _problem(rng)
    adam = CodebookAdam(weight, xtx, codebooks, scales, lr=1e-3)
    history = [float(relative_output_mse(weight, dequantize_weight(codes, codebooks, scales), xtx))]
    for _ in range(3):
        adam.run(codes, 30)
        history.append(float(relative_output_mse(weight, dequantize_weight(codes, adam.codebooks, adam.scales), xtx)))
    assert history == sorted(history, reverse=True) and history[-1] < history[0]
    assert float(adam.optimizer.step) == 90
