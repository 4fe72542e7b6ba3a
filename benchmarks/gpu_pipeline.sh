#!/usr/bin/env bash
# The SmolLM2 pipeline on the lent GPU machine (no network there): files are staged in
# /root/stage over several device calls (each call carries at most 64 MiB), then Snakemake runs
# the whole DAG with profiles/gpu. Run from the repository root on the device machine:
#   bash benchmarks/gpu_pipeline.sh install   # carry .whl and .device-carry/gpu-run/assets.tar.xz
#   bash benchmarks/gpu_pipeline.sh part F    # carry one GGUF part F (split -b 49M), once per part
#   bash benchmarks/gpu_pipeline.sh run SECONDS [snakemake args]   # resumable; results to $OUT
set -euo pipefail
STAGE=${STAGE:-/root/stage}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PY=${PYTHON:-python3}
export PYTHONPATH="$STAGE/site:$PWD/src" AQFLOW_CACHE="$STAGE/cache" PYTHONUNBUFFERED=1
mkdir -p "$STAGE/cache/smollm2" "$STAGE/parts"

case "$1" in
install)
  tar -xJf .device-carry/gpu-run/assets.tar.xz -C "$STAGE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" .whl/*.whl
  "$PY" -c "import snakemake, aqlm, lm_eval, datasets, gguf, matplotlib, torch, transformers; \
print('snakemake', snakemake.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  # aqlm compiles its CUDA kernels on first use (minutes): start that now, in its own session
  # so it outlives this call and the evaluation later finds them built.
  setsid nohup "$PY" -c "import aqlm.inference_kernels.cuda_kernel" > "$STAGE/aqlm_build.log" 2>&1 < /dev/null &
  ;;
part)
  cp "$2" "$STAGE/parts/" && ls -la "$STAGE/parts"
  ;;
run)
  seconds=$2; shift 2
  gguf="$STAGE/cache/smollm2/$GGUF_NAME"
  if [ ! -f "$gguf" ]; then cat "$STAGE"/parts/gguf.* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"; fi
  echo "$GGUF_SHA256  $gguf" | sha256sum -c -
  # Run in a copy outside the synced checkout: the device tool replaces the checkout's
  # unignored files (results/smollm2 is committed) at every call, which would delete the outputs
  # of the previous call; the copy keeps them, so the run resumes.
  mkdir -p "$STAGE/work"
  tar --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs \
      --exclude=./.whl --exclude=./.whl2 --exclude=./.device-carry --exclude=./.git --exclude=./.venv -cf - . | tar -C "$STAGE/work" -xf -
  cd "$STAGE/work"
  export PYTHONPATH="$STAGE/site:$PWD/src"
  mkdir -p resources && cp -r --update=none "$STAGE/resources/data" resources/
  cat "$STAGE/aqlm_build.log" || true
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  status=0
  timeout -s INT "$seconds" "$PY" -m snakemake --profile profiles/gpu --resources gpu=12 --scheduler greedy --keep-going "$@" || status=$?
  echo "snakemake exit status $status"
  cp .snakemake/log/*.snakemake.log "$STAGE/" 2>/dev/null || true
  "$PY" benchmarks/stage_times.py "$STAGE"/*.snakemake.log --json "$OUT/stage_times.json" | tee "$OUT/stage_times.txt"
  mkdir -p results; find results -name '*.json' -o -name '*.csv' -o -name '*.parquet' -o -name '*.png' | grep -v '/model/' \
    | tar -czf "$OUT/results.tar.gz" -T -
  tar -czf "$OUT/logs.tar.gz" logs "$STAGE"/*.snakemake.log 2>/dev/null || true
  ls -la "$OUT"
  ;;
esac
