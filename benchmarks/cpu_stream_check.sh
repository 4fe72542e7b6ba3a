#!/usr/bin/env bash
# Where the 16-core CPU decode of the 3B shape goes, on the GPU machine's host, in one device call:
# the register kernel with codes streamed from memory against cache-resident, by threads and prefetch
# distance (lut_stream.py); a per-module profile of one 2x8 and one dense decode step on all cores
# (inference_cpu_profile.py); then the decode itself, dense bf16 against 2x8 with and without the
# kernel's prefetch (AQFLOW_CPU_PREFETCH 8 / 0), torch on one thread, and both models with OpenMP's
# passive wait, in turn ROUNDS times (default 2). Run from the repository root:
#   bash benchmarks/cpu_stream_check.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba_cache}
PY=${PYTHON:-python3}
cores=$(nproc)
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)"
timeout 240 "$PY" benchmarks/lut_stream.py --threads 1 8 "$cores" --prefetch 0 8 --out "$out/lut_stream.json" \
  > "$out/lut_stream.txt" 2>&1
tail -26 "$out/lut_stream.txt"
timeout 150 "$PY" benchmarks/inference_cpu_profile.py --threads "$cores" --steps 8 > "$out/profile_2x8.txt" 2>&1
timeout 150 "$PY" benchmarks/inference_cpu_profile.py --threads "$cores" --steps 4 --linears dense \
  > "$out/profile_dense.txt" 2>&1
head -16 "$out/profile_2x8.txt"; head -12 "$out/profile_dense.txt"
decode() {  # decode NAME ENV... -- VARIANTS...
  local name=$1; shift
  local env=()
  while [ "$1" != "--" ]; do env+=("$1"); shift; done; shift
  env "${env[@]}" timeout 200 "$PY" benchmarks/inference_cpu.py --threads "$cores" --no-kernels --no-aqlm-kernel \
    --new-tokens 32 --repeats 1 --variants "$@" --out "$out/decode_$name.json" > "$out/decode_$name.txt" 2>&1
  grep -E "tokens/s" "$out/decode_$name.txt" | sed "s/^/$name: /"
}
for round in $(seq "${ROUNDS:-2}"); do
  decode "r${round}_prefetch8" AQFLOW_CPU_PREFETCH=8 -- "dense bf16 (numba GEMV)" "2x8 fast (bf16 rest)" \
    "2x8 fast (bf16 rest, torch 1 thread)"
  decode "r${round}_prefetch0" AQFLOW_CPU_PREFETCH=0 -- "2x8 fast (bf16 rest)"
done
decode passive OMP_WAIT_POLICY=passive -- "dense bf16 (numba GEMV)" "2x8 fast (bf16 rest)"
