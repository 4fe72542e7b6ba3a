"""Resumable PV-tuning: the loop's full state on disk every N steps, and a run that picks it up.

A PV-tuning job of a 3B model runs for hours; a killed one must not start again from step 0. The
state written is everything the next step depends on, so that a resumed run takes exactly the
steps an uninterrupted one would have taken (same held-out curve, same selected state):

* the student: packed codes, every P-step parameter, the V-step straight-through weights;
* both Adam optimisers' states (moments and step counts);
* the data position: the current epoch's window order, the next batch's offset, the epoch
  generator's state, and torch's global RNG state(s);
* the loop's record: the log so far, the initial and best held-out rows, the best state's snapshot.

Each process writes its own part (its shards of the sharded tensors, `aqflow.pvtune.distributed`;
process 0 also the codes, which every process holds alike) to `step-<N>/rank-<r>/`: tensors to
`state.safetensors`, the rest to `state.json`, one folder written with `artifacts.atomic_dir`
(checksummed, one rename). A step's state is whole once every process's folder exists; the
older ones are removed only after that, so a kill while saving leaves the previous whole state.
A state belongs to one run: `fingerprint` (settings, inputs, the number of processes) is stored
in it and a state with another fingerprint is ignored, never resumed from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aqflow.io.artifacts import atomic_dir, load_safetensors, read_json, save_safetensors, verified_tree, write_json
from ..quant.representation import pack_codes, unpack_codes
from .student import pv_linears

STATE_TENSORS = "state.safetensors"
STATE_RECORD = "state.json"
FORMAT = 2


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step:07d}"


def rank_folder(folder: Path, step: int, rank: int) -> Path:
    return step_folder(folder, step) / f"rank-{rank}"


def whole_steps(folder: Path, size: int) -> list[int]:
    """The saved steps of which every one of `size` processes' folders exists, newest first."""
    steps = []
    for path in folder.glob("step-*"):
        if path.name[len("step-"):].isdigit() and all((path / f"rank-{r}" / STATE_RECORD).is_file() for r in range(size)):
            steps.append(int(path.name[len("step-"):]))
    return sorted(steps, reverse=True)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@dataclass
class LoopState:
    """Where the loop stands after `step` optimiser steps (what `train` needs besides the model)."""

    step: int
    order: torch.Tensor | None  # this epoch's window order [n] int64, None at an epoch boundary
    next_batch: int  # offset in `order` of the next batch
    generator_state: torch.Tensor  # the epoch generator's state, [n] uint8 (torch.Generator.get_state)
    log: list[dict]
    initial: dict
    best: dict
    best_state: dict[str, torch.Tensor]  # train.snapshot: packed codes [out, G, M] and P-step parameters, CPU
    elapsed_seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Resumer:
    """Where and how often `train` saves its state, and the fingerprint that a saved state must
    carry to be resumed from. `every` steps (0: never)."""

    folder: Path
    every: int
    fingerprint: dict

    def due(self, step: int, total_steps: int) -> bool:
        return self.every > 0 and step % self.every == 0 and step < total_steps

    def save(self, student: nn.Module, optimizers: dict[str, torch.optim.Optimizer | None], loop: LoopState) -> None:
        """Every process writes its part of step `loop.step`; then the older steps are removed."""
        from .distributed import world

        rank, size = world()
        save_state(rank_folder(self.folder, loop.step, rank), student, optimizers, loop, self.fingerprint, rank == 0)
        _barrier()  # every part of this step is written before an older whole state goes
        if rank == 0:
            import shutil

            for older in whole_steps(self.folder, size)[1:]:
                shutil.rmtree(step_folder(self.folder, older), ignore_errors=True)

    def load(self, student: nn.Module, optimizers: dict[str, torch.optim.Optimizer | None]) -> LoopState | None:
        """The newest whole saved loop state with student and optimisers restored, or None (no
        state, or one of another run: reported on stdout and left alone)."""
        from .distributed import world

        rank, size = world()
        steps = whole_steps(self.folder, size) if self.folder.is_dir() else []
        if not steps:
            return None
        record = read_json(rank_folder(self.folder, steps[0], rank) / STATE_RECORD)
        if record.get("fingerprint") != _jsonable(self.fingerprint) or record.get("format") != FORMAT:
            if rank == 0:
                print(f"{self.folder}: a saved PV-tuning state of other settings or inputs; starting from step 0",
                      flush=True)
            return None
        loop = load_state(rank_folder(self.folder, steps[0], rank), rank_folder(self.folder, steps[0], 0), student,
                          optimizers)
        if rank == 0:
            print(f"{self.folder}: resuming PV-tuning after step {loop.step}", flush=True)
        return loop

    def finish(self) -> None:
        """Remove the saved state once the run's outputs are written."""
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def run_fingerprint(settings: dict, data: dict, inputs: list[str | os.PathLike]) -> dict:
    """What makes a saved state this run's: the settings, the data record and each input's
    recorded checksums (a folder's SHA256SUMS digest, a file's sidecar digest)."""
    from aqflow.io.artifacts import SUMS_FILE, file_sha256, has_record, recorded_sha256

    digests = {}
    for path in map(Path, inputs):
        if (path / SUMS_FILE).is_file():
            digests[str(path)] = file_sha256(path / SUMS_FILE)
        elif path.is_file() and has_record(path):
            digests[str(path)] = recorded_sha256(path)
        else:  # no record: the file itself (small inputs, or made by hand)
            digests[str(path)] = file_sha256(path) if path.is_file() else None
    return {"settings": settings, "data": data, "inputs": digests}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _parameter_names(student: nn.Module) -> dict[int, str]:
    return {id(parameter): name for name, parameter in student.named_parameters()}


def _saved_parameters(student: nn.Module) -> dict[str, torch.Tensor]:
    """What training changes besides the codes: every trainable parameter and every
    straight-through weight (also one in host memory, which takes no gradient), this process's part."""
    from .distributed import local

    return {name: local(parameter.detach()) for name, parameter in student.named_parameters()
            if parameter.requires_grad or name.endswith(".straight_through")}


def save_state(folder: str | os.PathLike, student: nn.Module, optimizers: dict[str, torch.optim.Optimizer | None],
               loop: LoopState, fingerprint: dict, with_codes: bool = True) -> Path:
    """Write this process's part of the loop's state to `folder` atomically (replacing an earlier one).

    state.safetensors holds, on the CPU: "student/<layer>.codes" [out, G, M] packed int8/int16
    (`with_codes`), "student/<parameter>" for every trainable parameter and straight-through
    weight (this process's part, float32), "optim/<key>/<parameter>/<slot>" (Adam's exp_avg and
    exp_avg_sq in the parameter's part's shape, step 0-dim float32), "best/<name>" the best
    snapshot, "loop/order" [n] int64, and the generator and RNG states [*] uint8.
    """
    from .distributed import local

    tensors: dict[str, torch.Tensor] = {}
    if with_codes:
        for name, layer in pv_linears(student).items():
            tensors[f"student/{name}.codes"] = pack_codes(layer.codes, layer.nbits).cpu()
    for name, value in _saved_parameters(student).items():
        tensors[f"student/{name}"] = value.cpu()
    names = _parameter_names(student)
    optimizer_records = {}
    for key, optimizer in optimizers.items():
        if optimizer is None:
            continue
        order = [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
        per_param = {}
        for parameter, values in optimizer.state.items():
            name = names[id(parameter)]
            entries = {}
            for slot, value in values.items():
                if torch.is_tensor(value):
                    tensors[f"optim/{key}/{name}/{slot}"] = local(value.detach()).cpu()
                    entries[slot] = "tensor"
                else:
                    entries[slot] = value
            per_param[name] = entries
        optimizer_records[key] = {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                   for g in optimizer.state_dict()["param_groups"]],
                                  "order": order, "state": per_param}
    for name, value in loop.best_state.items():
        tensors[f"best/{name}"] = value
    if loop.order is not None:
        tensors["loop/order"] = loop.order
    tensors["loop/generator_state"] = loop.generator_state
    tensors["loop/torch_rng_state"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["loop/cuda_rng_state"] = torch.cuda.get_rng_state()
    record = {
        "format": FORMAT,
        "fingerprint": _jsonable(fingerprint),
        "step": loop.step,
        "next_batch": loop.next_batch,
        "log": loop.log,
        "initial": loop.initial,
        "best": loop.best,
        "elapsed_seconds": loop.elapsed_seconds,
        "timings": loop.timings,
        "optimizers": optimizer_records,
    }
    folder = Path(folder)
    with atomic_dir(folder) as staging:
        save_safetensors(staging / STATE_TENSORS, {k: v.contiguous() for k, v in tensors.items()})
        write_json(staging / STATE_RECORD, _jsonable(record))
    return folder


def _like(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """A saved optimiser state tensor as its parameter holds it: a DTensor of the parameter's
    sharding (from this process's part) for a sharded parameter, on the parameter's device."""
    if hasattr(parameter, "to_local") and value.dim() > 0:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.to(parameter.to_local().device), parameter.device_mesh, parameter.placements,
                                  run_check=False, shape=parameter.shape, stride=parameter.stride())
    return value


@torch.no_grad()
def load_state(folder: str | os.PathLike, codes_folder: str | os.PathLike, student: nn.Module,
               optimizers: dict[str, torch.optim.Optimizer | None]) -> LoopState:
    """Restore student and optimisers from this process's `folder` and the codes from
    `codes_folder` (process 0's), both checked against their checksums; the loop state."""
    from .distributed import local

    folder = verified_tree(folder, required=True)
    record = read_json(folder / STATE_RECORD)
    tensors = load_safetensors(folder / STATE_TENSORS)
    codes = tensors if Path(codes_folder) == folder else load_safetensors(verified_tree(codes_folder, required=True)
                                                                          / STATE_TENSORS)
    parameters = dict(student.named_parameters())
    for name, layer in pv_linears(student).items():
        layer.codes.copy_(unpack_codes(codes[f"student/{name}.codes"], layer.nbits).to(layer.codes.device))
    for key, value in tensors.items():
        if key.startswith("student/") and not key.endswith(".codes"):
            local(parameters[key[len("student/"):]]).copy_(value)
    for key, optimizer in optimizers.items():
        if optimizer is None:
            continue
        saved = record["optimizers"][key]
        state = {}
        for index, name in enumerate(saved["order"]):
            if name not in saved["state"]:
                continue
            state[index] = {slot: (_like(tensors[f"optim/{key}/{name}/{slot}"], parameters[name]) if kind == "tensor"
                                   else kind)
                            for slot, kind in saved["state"][name].items()}
        groups = []
        start = 0
        for group, current in zip(saved["param_groups"], optimizer.state_dict()["param_groups"]):
            count = len(current["params"])
            groups.append(dict(group, params=list(range(start, start + count))))
            start += count
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["loop/torch_rng_state"])
    if "loop/cuda_rng_state" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["loop/cuda_rng_state"])
    return LoopState(
        step=record["step"],
        order=tensors.get("loop/order"),
        next_batch=record["next_batch"],
        generator_state=tensors["loop/generator_state"],
        log=record["log"],
        initial=record["initial"],
        best=record["best"],
        best_state={key[len("best/"):]: value for key, value in tensors.items() if key.startswith("best/")},
        elapsed_seconds=record["elapsed_seconds"],
        timings=record["timings"],
    )
