#!/usr/bin/env bash
# CPU decode of the Llama-3.2-3B shape on all cores of a box (issue 27's CPU target), in one device
# call: the kernels one thread at a time, the products by thread count, then batch-1 decode of the
# random 3B model (dense bf16 through the numba GEMV, 2x8 through the register kernel with the
# tables it times faster for the bf16 activations, with float32 ones and with float16 ones, and
# through the gathers) and where a decode step goes, each with OpenMP's default wait policy and with
# OMP_WAIT_POLICY=PASSIVE (threads that sleep as soon as a parallel region ends instead of spinning
# on the cores the other thread pool needs; POLICIES="default" skips it). Run from the repository root:
#   bash benchmarks/cpu_decode_check.sh OUT_DIR [THREADS]      # THREADS default: every core
# Writes OUT_DIR/{lut_registers.json, lut_threads.json, decode_<policy>.json,
# profile_<policy>.txt} (8 files: as many as a device call returns) and prints the processor and the
# decode table of each policy last.
set -uo pipefail
out=${1:?OUT_DIR}
threads=${2:-$(nproc)}
mkdir -p "$out"
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba_cache} PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|L2|L3"
"$PY" benchmarks/lut_registers.py --repeats 20 --out "$out/lut_registers.json" 2>&1 | tail -7
"$PY" benchmarks/lut_threads.py --threads 1 "$threads" --calls 20 --rounds 3 --out "$out/lut_threads.json" 2>&1 | tail -22
policies=${POLICIES:-default PASSIVE}
for policy in $policies; do
  run() { if [ "$policy" = default ]; then "$@"; else OMP_WAIT_POLICY=$policy "$@"; fi; }
  run "$PY" benchmarks/inference_cpu_profile.py --threads "$threads" --steps 3 > "$out/profile_$policy.txt" 2>&1
  run "$PY" benchmarks/inference_cpu.py --threads "$threads" --no-kernels --no-aqlm-kernel --new-tokens 16 --repeats 2 \
    --variants "dense bf16 (numba GEMV)" "2x8 fast (bf16 rest)" "2x8 fast (bf16 rest, float32 tables)" \
    "2x8 fast (bf16 rest, float16 tables)" "2x8 fast (bf16 rest, gather kernel)" \
    --out "$out/decode_$policy.json" > "$out/decode_$policy.txt" 2>&1
done
for policy in $policies; do
  echo "== OMP_WAIT_POLICY $policy: where a 2x8 step goes"
  grep -E "^step|^  " "$out/profile_$policy.txt" | head -12
done
for policy in $policies; do
  echo "== OMP_WAIT_POLICY $policy: decode"
  grep -A8 "batch-1 decode  " "$out/decode_$policy.txt" | grep -v "^--"
done
