"""Which finished results are current: decided for every input of every job while Snakemake builds
the DAG, so that a named target, a plain `snakemake` and `snakemake -n` agree.

Snakemake reruns a job for a changed setting (params), a newer or changed input, or a missing
output of a job it runs anyway; a missing output of a job whose results downstream look up to
date is taken for a removed intermediate file and left missing. Two ways a result goes stale
without any of those triggers firing:

* a job is killed while Snakemake runs on: Snakemake removes the job's outputs and records its
  metadata as if it had finished (settings included), so the job's changed setting no longer
  shows, and the results made from its old outputs (an eval.json after a killed PV-tuning) are
  served as current;
* a file is removed by hand (the advice for a corrupt one), or a file inside a folder output goes
  missing: Snakemake sees the folder and does not redo it.

The rule here: an input that is missing while an output of the job that reads it exists, and a
folder input that lacks a file its SHA256SUMS lists, are rebuilt (the Snakefile forces the job
that writes them, and Snakemake reruns everything downstream); a temporary input (removed once
used by design) is exempt. An input whose bytes differ from their checksum record is refused by
name with advice that works when followed literally (delete the file: it is then rebuilt).
Integrity is checked through `DigestCache` (aqflow.io.integrity): unchanged files are not hashed again.

`InputGuard` is pure Python; `WorkflowGuard` binds it to a Snakemake run (common.smk makes one).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from aqflow.io.artifacts import SUMS_FILE
from aqflow.io.integrity import CORRUPT, MISSING, UNLISTED, Damage, DigestCache, damage, stat_signature


@dataclass(frozen=True)
class Verdict:
    """`rebuild`: the path (an output of some job) to write again, with `reason`; or `refusal`: the
    message to stop with (a corrupt artifact)."""

    rebuild: str | None = None
    refusal: str | None = None
    reason: str = ""


def refusal_message(found: Damage) -> str:
    """One line naming the damaged file, what is wrong, and how to redo it (literally)."""
    if found.kind == UNLISTED:
        return f"{found.describe()}; remove it (or delete the folder {found.folder}) and rerun"
    if found.folder is None:
        return f"{found.describe()}; redo it: delete {found.path} and rerun"
    if found.path.name == SUMS_FILE:  # without its record a folder would pass unchecked
        return f"{found.describe()}; redo it: delete the folder {found.folder} and rerun"
    return (f"{found.describe()}; redo it: delete {found.path} (or the folder {found.folder}) and rerun: "
            f"the folder is written again")


class InputGuard:
    """Verdicts on the inputs of the jobs of one DAG build. Remembers the verdict on an existing
    path by its stat signature (a folder read by 200 layer jobs is checked once per build)."""

    def __init__(self, cache: DigestCache):
        self.cache = cache
        self._seen: dict[tuple[str, tuple], Verdict | None] = {}

    def existing(self, path: str) -> Verdict | None:
        """The verdict on a path that exists (None: intact, or without a checksum record)."""
        key = (path, stat_signature(path))
        if key not in self._seen:
            found = damage(path, self.cache)
            if found is None:
                verdict = None
            elif found.kind == MISSING:
                verdict = Verdict(rebuild=path, reason=f"{found.path} is missing from the folder {path} "
                                                       f"(its SHA256SUMS lists it)")
            else:
                verdict = Verdict(refusal=refusal_message(found))
            self._seen[key] = verdict
        return self._seen[key]

    def check(self, path: str, consumer_outputs: Iterable[str], temporary: bool = False) -> Verdict | None:
        """The verdict on input `path` of a job whose outputs are `consumer_outputs`."""
        if os.path.lexists(path):
            return self.existing(path)
        if temporary:
            return None
        made = next((output for output in consumer_outputs if os.path.lexists(output)), None)
        if made is None:  # the job runs anyway, and Snakemake makes its missing input first
            return None
        return Verdict(rebuild=path, reason=f"{path} is missing, but {made}, which reads it, exists")

    def check_state(self, folder: str, what: str) -> Verdict | None:
        """A folder beside a job's outputs that the job resumes from (PV-tuning's state): damaged,
        it is refused with the advice to delete it (the job then starts over)."""
        if not os.path.isdir(folder):
            return None
        # the folder and every checksummed folder inside it (PV-tuning writes one per step and process)
        parts = [folder] + sorted(str(sums.parent) for sums in Path(folder).rglob(SUMS_FILE) if sums.parent != Path(folder))
        found = next((damaged for damaged in (damage(part, self.cache) for part in parts) if damaged), None)
        if found is None:
            return None
        kind = CORRUPT if found.kind != MISSING else MISSING
        return Verdict(refusal=f"{found.path}: {kind}: {found.detail}; delete the folder {folder} and rerun "
                               f"({what} then starts from the beginning)")


def digest_cache_path(workdir: str | os.PathLike = ".") -> Path:
    """Where a working directory's DigestCache lives (beside Snakemake's own records)."""
    return Path(workdir) / ".snakemake" / "aqflow" / "digests.json"


class WorkflowGuard:
    """An InputGuard bound to one Snakemake run: it builds the rules' input functions and carries out
    the verdicts in Snakemake's terms. Checks run in the main Snakemake process only (a cluster
    job's own Snakemake does not redo them).

    workflow: Snakemake's `workflow` object (dag.forcefiles, is_main_process); rules: its `rules`;
    output_path(pattern, **wildcards) -> str: how common.smk spells a rule's output."""

    def __init__(self, guard: InputGuard, workflow, rules, output_path: Callable[..., str]):
        self.guard, self.workflow, self.rules, self.output_path = guard, workflow, rules, output_path
        self.started = False  # set when jobs start (onstart)
        self.rebuilt: set[str] = set()

    def act_on(self, verdict: Verdict | None) -> None:
        """Refuse (a corrupt input) or force the job that rebuilds a lost one."""
        if verdict is None:
            return
        if verdict.refusal:
            if self.started:
                # jobs run now (a checkpoint's dependents re-planned): fail like any input function,
                # instead of ending Snakemake under its running jobs
                raise ValueError(verdict.refusal)
            # not an Exception: Snakemake would take an input function's error for "no producer" of
            # a file that exists, and go on without the check
            raise SystemExit(f"aqflow: {verdict.refusal}")
        # as Snakemake itself forces jobs with incomplete outputs (--rerun-incomplete)
        self.workflow.dag.forcefiles.add(verdict.rebuild)
        if verdict.rebuild not in self.rebuilt:
            self.rebuilt.add(verdict.rebuild)
            print(f"aqflow: {verdict.reason}: its job runs again", file=sys.stderr)

    def inputs(self, rule: str, source, temporary: bool = False) -> Callable:
        """An input function: the paths of `source` (a path or pattern, a list of them, or an input
        function) for a job of `rule`, each checked, and the job's own finished outputs too (a named
        target is nobody's input). `temporary`: inputs removed once used (a missing one is expected)."""
        from snakemake.exceptions import IncompleteCheckpointException

        from aqflow.jobs.plan import wildcard_values

        def outputs(values):
            return [self.output_path(pattern, **values) for pattern in getattr(self.rules, rule).output]

        def paths_of(wildcards, values):
            if callable(source):
                return source(wildcards)
            if isinstance(source, str):
                return self.output_path(source, **values)
            return [self.output_path(path, **values) for path in source]

        def checked(wildcards):
            values = wildcard_values(wildcards)
            main = self.workflow.is_main_process
            try:
                paths = paths_of(wildcards, values)
            except IncompleteCheckpointException as pending:
                if main:
                    self.act_on(self.guard.check(str(pending.targetfile), outputs(values)))
                raise
            if main:
                for path in [paths] if isinstance(paths, str) else paths:
                    self.act_on(self.guard.check(str(path), outputs(values), temporary))
                for output in outputs(values):
                    if os.path.lexists(output):
                        self.act_on(self.guard.existing(output))
            return paths

        return checked

    def state(self, folder: str, what: str) -> list:
        """No input: a resumable state folder (PV-tuning's), refused while the DAG is built if damaged."""
        if self.workflow.is_main_process:
            self.act_on(self.guard.check_state(folder, what))
        return []
