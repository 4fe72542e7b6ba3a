"""Why a decode test failed with the gated MLP (benchmarks/patches/gated_mlp.patch; session 32): run on a GPU in a
copy of the repository with the patch applied, from its root (PYTHONPATH=src:. python3 benchmarks/gated_mlp_diagnose.py).

The test's tiny Llama (llama_with_kernel_linears(512, seed=8)) is decoded 12 tokens closed (no open sums), gated and
apart (open sums, no MLP recognized); then, fed the closed tokens, each step's logits under the three, with the closed
step's lead of its best token over the runner-up; then one MLP's down product from the gate/up sums, formed in the
kernel against torch's input (in bf16 as the model's MLP rounds, and in fp32 rounded once).
Output: results/gated_mlp_h200/diagnose.txt."""

import contextlib
import sys

import torch

sys.path.insert(0, ".")
from aqflow.inference import gpu_kernels as gk, open_sums as osm  # noqa: E402
from aqflow.inference.decode import greedy_decode, new_static_cache, step_logits  # noqa: E402
from tests.inference.test_dependent_launch import llama_with_kernel_linears  # noqa: E402


@contextlib.contextmanager
def gating(gated: bool):
    """Within the block the patch recognizes its MLPs (gated) or none of them (the step as on main)."""
    saved = osm.GATED_MLPS
    osm.GATED_MLPS = saved if gated else frozenset()
    try:
        yield
    finally:
        osm.GATED_MLPS = saved


def decoded(model, prompt, open_sums: bool, gated: bool) -> list[int]:
    with gating(gated):
        return greedy_decode(model, prompt, 12, compile=False, open_sums=open_sums)[0].reshape(-1).tolist()


def teacher_forced_logits(model, prompt, tokens: list[int], open_sums: bool, gated: bool) -> torch.Tensor:
    """[12, vocab] float32: the logits of each step fed `tokens`."""
    with gating(gated):
        cache = new_static_cache(model, 64)
        model(input_ids=prompt.cuda(), position_ids=torch.arange(6, device="cuda")[None], past_key_values=cache,
              use_cache=True)
        logits = []
        for i, token in enumerate([int(prompt[0, -1])] + tokens[:-1]):
            with osm.open_sums_enabled(model, open_sums) as sums:
                logits.append(step_logits(model, cache, torch.tensor([[token]], device="cuda"),
                                          torch.tensor([[5 + i]], device="cuda")).float())
                if sums is not None:
                    sums.zero()
        return torch.cat(logits)


def main() -> None:
    model, generator = llama_with_kernel_linears(512, seed=8)
    prompt = torch.randint(0, 97, (1, 6), generator=generator)
    runs = {"closed": (False, False), "gated": (True, True), "apart": (True, False)}
    tokens = {name: decoded(model, prompt, *flags) for name, flags in runs.items()}
    for name, values in tokens.items():
        print(f"{name:7s}", values)
    with torch.inference_mode():
        logits = {name: teacher_forced_logits(model, prompt, tokens["closed"], *flags) for name, flags in runs.items()}
        closed = logits["closed"]
        top = closed.topk(2, dim=-1).values
        for i in range(closed.shape[0]):
            print(f"step {i:2d}  closed lead {float(top[i, 0] - top[i, 1]):.4f}  "
                  f"max |gated - closed| {float((logits['gated'][i] - closed[i]).abs().max()):.4f}  "
                  f"max |apart - closed| {float((logits['apart'][i] - closed[i]).abs().max()):.4f}")
        with osm.open_sums_enabled(model) as sums:
            gate_up, down = osm._gated_sites(model.model.layers[0].mlp)
            x = torch.randn(1, 1, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            gate_up_sums = gate_up.unfinished(x.to(torch.bfloat16)).clone()
            formed = down.gated(gate_up_sums, gate_up).clone()
            sums.zero()
            gate, up = gk.finished_sums(gate_up_sums, gate_up.packed).split(down.packed.in_features, -1)
            silu = torch.nn.functional.silu
            for name, inputs in (("bf16 as the MLP", silu(gate) * up),
                                 ("fp32, rounded once", (silu(gate.float()) * up.float()).to(torch.bfloat16))):
                reference = gk.open_packed_matmul(inputs, down.packed, down.config, down.sums).clone()
                sums.zero()
                print(f"down product, input formed in the kernel vs torch's {name}: "
                      f"{int((formed != reference).sum())} of {reference.numel()} outputs differ, max |difference| "
                      f"{float((formed.float() - reference.float()).abs().max())} (largest output "
                      f"{float(reference.float().abs().max())})")


if __name__ == "__main__":
    main()
