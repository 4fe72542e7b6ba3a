"""The V-step's Adam without a first moment (aqflow.pvtune.vstep_adam): the same steps as
torch.optim.Adam at beta1 = 0, half the state, and a resumable state."""

import torch

from aqflow.pvtune.vstep_adam import SecondMomentAdam, v_step_optimizer


def _trajectory(make_optimizer, steps: int = 6) -> list[torch.Tensor]:
    """Parameters after each of `steps` steps on a fixed sequence of gradients, two groups at two lrs."""
    generator = torch.Generator().manual_seed(0)
    first = torch.nn.Parameter(torch.randn(5, 8, generator=generator))
    second = torch.nn.Parameter(torch.randn(3, 4, generator=generator))
    optimizer = make_optimizer([{"params": [first], "lr": 1e-2}, {"params": [second], "lr": 3e-3}])
    states = []
    for _ in range(steps):
        # gradients of changing size and sign, one of them zero in places
        first.grad = torch.randn(first.shape, generator=generator) * torch.rand((), generator=generator) * 10
        second.grad = torch.randn(second.shape, generator=generator).clamp(min=0)
        optimizer.step()
        states.append(torch.cat([first.detach().flatten(), second.detach().flatten()]).clone())
    return states


def test_steps_equal_torch_adam_at_beta1_zero():
    ours = _trajectory(lambda groups: SecondMomentAdam(groups, beta2=0.95))
    torch_adam = _trajectory(lambda groups: torch.optim.Adam(groups, betas=(0.0, 0.95), foreach=False))
    for step, (mine, reference) in enumerate(zip(ours, torch_adam)):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-7, msg=f"step {step + 1}")
    assert not torch.equal(ours[0], ours[-1])  # the steps moved the parameters


def test_keeps_one_moment_where_adam_keeps_two():
    weight = torch.nn.Parameter(torch.zeros(4, 8))
    weight.grad = torch.ones(4, 8)
    ours, theirs = v_step_optimizer([{"params": [weight], "lr": 0.1}], 0.0, 0.95), \
        v_step_optimizer([{"params": [weight], "lr": 0.1}], 0.9, 0.95)
    ours.step()
    theirs.step()
    assert isinstance(ours, SecondMomentAdam) and isinstance(theirs, torch.optim.Adam)
    moments = lambda optimizer: [k for k, v in optimizer.state[weight].items() if v.shape == weight.shape]
    assert moments(ours) == ["exp_avg_sq"] and sorted(moments(theirs)) == ["exp_avg", "exp_avg_sq"]


def test_state_dict_resumes_the_same_steps():
    def run(resume_after: int | None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        weight = torch.nn.Parameter(torch.randn(6, 8, generator=generator))
        optimizer = SecondMomentAdam([weight], lr=1e-2, beta2=0.95)
        for step in range(5):
            weight.grad = torch.randn(weight.shape, generator=generator)
            optimizer.step()
            if step == resume_after:  # a fresh optimiser from the saved state, as Resumer does
                saved = optimizer.state_dict()
                optimizer = SecondMomentAdam([weight], lr=1e-2, beta2=0.95)
                optimizer.load_state_dict(saved)
        return weight.detach().clone()

    torch.testing.assert_close(run(resume_after=2), run(resume_after=None), rtol=0, atol=0)


def test_resumes_from_the_state_torch_adam_saved():
    """A run interrupted under torch's Adam (before this optimiser) resumes here on the same path."""
    def run(switch_after: int | None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(2)
        weight = torch.nn.Parameter(torch.randn(6, 8, generator=generator))
        optimizer = torch.optim.Adam([weight], lr=1e-2, betas=(0.0, 0.95), foreach=False)
        for step in range(5):
            weight.grad = torch.randn(weight.shape, generator=generator)
            optimizer.step()
            if step == switch_after:
                saved = optimizer.state_dict()
                optimizer = SecondMomentAdam([weight], lr=1e-2, beta2=0.95)
                optimizer.load_state_dict(saved)
        return weight.detach().clone()

    torch.testing.assert_close(run(switch_after=1), run(switch_after=None), rtol=1e-6, atol=1e-7)
