#!/usr/bin/env bash
# A/B of kernel variants on one GPU machine (issue 27): each NAME=SRC (a copy of the package's src/
# folder, e.g. `git archive COMMIT src | tar -x -C DIR`) decodes the shapes of MODELS (default 3B) through
# benchmarks/inference_gpu.py with its own extension build, in the order given; the step times of one
# machine compare, those of two machines do not. TESTS=NAME first runs the CUDA kernel tests against that
# variant's source, and a variant whose tests fail is not timed (the script stops); MODELS (default 3b),
# BUDGET (seconds, default 170) and ARGS (e.g. --skip-kernels) go to inference_gpu.py. Each variant compiles
# into an inductor cache of its own (no variant is served another's compiled step); CODE="NAME ..." keeps the
# Python modules inductor generated for those variants (the compiled steps, their Triton kernels inline) as
# OUT_DIR/code_NAME.tgz.
# Run from the repository root:
#   bash benchmarks/decode_ab.sh OUT_DIR a=ab/a/src b=src [c=ab/c/src ...]
set -uo pipefail
out=${1:?OUT_DIR}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
for pair in "$@"; do
  name=${pair%%=*} src=${pair#*=}
  if [ "${TESTS:-}" = "$name" ]; then
    mkdir -p "$work/tests_$name" && cp -r "$src" "$work/tests_$name/src" && cp -r tests "$work/tests_$name/tests"
    (cd "$work/tests_$name" && TORCH_EXTENSIONS_DIR="$work/ext_$name" PYTHONPATH=src TRITON_INTERPRET=0 timeout 240 \
       python3 -m pytest -q -p no:cacheprovider tests/inference/test_cuda_kernels.py \
       tests/inference/test_dependent_launch.py tests/inference/test_open_sums.py tests/inference/test_cuda_layers.py) > "$out/tests_$name.log" 2>&1
    echo "== tests $name: $(tail -1 "$out/tests_$name.log")"
    grep -qE "[0-9]+ passed" "$out/tests_$name.log" && ! grep -qE "failed|error" "$out/tests_$name.log" ||
      { echo "tests of $name failed: not timed"; exit 1; }
  fi
  TORCH_EXTENSIONS_DIR="$work/ext_$name" TORCHINDUCTOR_CACHE_DIR="$work/inductor_$name" PYTHONPATH="$src:." timeout $((${BUDGET:-170} + 40)) python3 benchmarks/inference_gpu.py \
    --models "${MODELS:-3b}" --budget-seconds "${BUDGET:-170}" ${ARGS:-} --out "$out/$name" > "$out/$name.log" 2>&1
  echo "== $name ($src)"; grep -E "decode compile\+graph|speed-up|logits" "$out/$name.log"
  if [[ " ${CODE:-} " == *" $name "* ]]; then
    (cd "$work/inductor_$name" && grep -rl --include='*.py' "def call(" . | tar -czf "$out/code_$name.tgz" -T -)
  fi
done
