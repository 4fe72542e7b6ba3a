#!/usr/bin/env bash
# The one-token CPU layers (aqflow.inference.cpu_layers) against the modules' own forwards, on the GPU
# machine's host, in one device call: the decode tests (greedy_decode's options; Triton interpreted on
# the CPU as in CI, tests/conftest.py), then the 3B-shaped CPU decode on all cores, dense bf16 and 2x8,
# each with the CPU layers (the default) and with the stock modules, the four in turn ROUNDS times
# (default 2; ~150 s a round with 32 new tokens), best of each kept.
# Run from the repository root:
#   bash benchmarks/cpu_layers_check.sh OUT_DIR
# Writes OUT_DIR/{tests.log, decode.json, decode.txt} and OUT_DIR/all.tar.gz (a device call returns few files).
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba_cache}
PY=${PYTHON:-python3}
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_decode.py \
  tests/inference/test_cpu_layers.py > "$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log")"
timeout 420 "$PY" benchmarks/inference_cpu.py --threads "$(nproc)" --no-kernels --no-aqlm-kernel --new-tokens 32 \
  --repeats 1 --rounds "${ROUNDS:-2}" --variants "dense bf16 (numba GEMV)" "dense bf16 (numba GEMV, stock layers)" \
  "2x8 fast (bf16 rest)" "2x8 fast (bf16 rest, stock layers)" --out "$out/decode.json" > "$out/decode.txt" 2>&1
cat "$out/decode.txt"
(cd "$out" && tar -czf all.tar.gz $(ls tests.log decode.json decode.txt 2>/dev/null))
