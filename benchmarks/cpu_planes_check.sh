#!/usr/bin/env bash
# The register kernel's byte-plane tables (float32 with AVX-512 VBMI; int16 with VBMI and VNNI) against
# float16 tables, on the GPU machine's host, in one device call: the register kernel's tests, then each
# 3B linear's product with the codes streamed (lut_stream.py, 16 and 8 threads, the kinds in $TABLES),
# then the 3B-shaped CPU decode on all cores: dense bf16 and 2x8 (the default: tables timed for the bf16
# activations), 2x8 with float16 tables, 2x8 with int16 tables, in turn ROUNDS times (default 2), best
# of each kept.
# Run from the repository root:
#   bash benchmarks/cpu_planes_check.sh OUT_DIR
# Writes OUT_DIR/{tests.log, lut_stream.json, lut_stream.txt, decode.json, decode.txt} and
# OUT_DIR/all.tar.gz (a device call returns few files).
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba_cache}
PY=${PYTHON:-python3}
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|MHz"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_register_kernel.py > "$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log")"
timeout 240 "$PY" benchmarks/lut_stream.py --threads "$(nproc)" 8 --prefetch 8 --rounds 3 \
  --tables ${TABLES:-float16 float32-planes int16} \
  --out "$out/lut_stream.json" > "$out/lut_stream.txt" 2>&1
tail -14 "$out/lut_stream.txt"
timeout "${DECODE_SECONDS:-420}" "$PY" benchmarks/inference_cpu.py --threads "$(nproc)" --no-kernels --no-aqlm-kernel \
  --new-tokens 32 --repeats 1 --rounds "${ROUNDS:-2}" --variants "dense bf16 (numba GEMV)" "2x8 fast (bf16 rest)" \
  "2x8 fast (bf16 rest, float16 tables)" "2x8 fast (bf16 rest, int16 tables)" \
  --out "$out/decode.json" > "$out/decode.txt" 2>&1
cat "$out/decode.txt"
(cd "$out" && tar -czf all.tar.gz $(ls tests.log lut_stream.json lut_stream.txt decode.json decode.txt 2>/dev/null))
