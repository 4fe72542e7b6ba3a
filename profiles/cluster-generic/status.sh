#!/usr/bin/env bash
# Status of one Slurm job for Snakemake's cluster-generic executor: prints running, success or
# failed. Argument: what `sbatch --parsable` printed (a job id, maybe followed by ";cluster").
set -uo pipefail
job="${1%%;*}"
state=$(sacct --jobs "$job" --allocations --noheader --parsable2 --format=State 2>/dev/null | head -n 1)
if [ -z "$state" ]; then  # no accounting database: the controller still knows recent jobs
  state=$(squeue --jobs "$job" --states=all --noheader --format=%T 2>/dev/null | head -n 1)
fi
case "${state%% *}" in
  COMPLETED) echo success ;;
  ""|PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED|REQUEUED|REQUEUE_HOLD|REQUEUE_FED|RESIZING|STAGE_OUT|SIGNALING)
    echo running ;;
  *) echo failed ;;
esac
