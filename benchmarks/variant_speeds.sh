# Sourced, not run: the machinery of a kernel-variant check (build_phase_check.sh, codebook_latency_check.sh,
# gemv_timeline_check.sh), in one device call. The check sets `names` (variants whose decode speed is measured)
# and `timelines` (variants also measured with benchmarks/patches/gemv_timeline.patch applied: the split-K CTAs'
# phases) and defines make_variant NAME BASE DEST, which writes DEST/src: a copy of BASE/src with the variant's
# edits (`edit` and the shared edits of benchmarks/kernel_edits.sh; `m` conventionally the code as it is).
# Then, with the output folder as the argument:
#   source benchmarks/variant_speeds.sh OUT_DIR
# every variant is made from src/ as it is (or the folder SRC names) and, for `timelines`, from a patched
# copy; all extensions build in parallel; each plain variant decodes both shapes (benchmarks/gemv_timeline.py:
# SHAPES, default 3b,8b; the GEMVs on the configurations of CONFIGS; 256 new tokens), `m` again last to show
# the spread between runs, then each patched one (64 tokens). Each run writes OUT_DIR/NAME/gemv_timeline.{txt,
# json}, a patched one OUT_DIR/t_NAME/ (a device call returns only a few files: tar OUT_DIR).
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
configs=$(pwd)/${CONFIGS:-benchmarks/results/thread_tiles_h200/b/inference_gpu.json}
work=$(mktemp -d)
mkdir -p "$work/plain" "$work/patched"
cp -r "${SRC:-src}" "$work/plain/src" && cp -r "${SRC:-src}" "$work/patched/src"
(cd "$work/patched" && git apply "$OLDPWD/benchmarks/patches/gemv_timeline.patch")
source benchmarks/kernel_edits.sh  # edit, and edits the checks share
runs=""
for name in $names; do make_variant "$name" "$work/plain" "$work/$name"; runs="$runs $name"; done
for name in $timelines; do make_variant "$name" "$work/patched" "$work/t_$name"; runs="$runs t_$name"; done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for run in $runs; do  # the extensions in parallel
  (TORCH_EXTENSIONS_DIR="$work/ext_$run" PYTHONPATH="$work/$run/src" MAX_JOBS=4 \
     python3 -c "from aqflow.inference import cuda_kernels; cuda_kernels.load_extension()" > "$out/build_$run.log" 2>&1 ||
     echo "build of $run failed") &
done
wait
decode() {  # run label tokens
  mkdir -p "$out/$2"
  TORCH_EXTENSIONS_DIR="$work/ext_$1" PYTHONPATH="$work/$1/src:benchmarks" PYTHONUNBUFFERED=1 timeout 240 \
    python3 benchmarks/gemv_timeline.py --shapes "${SHAPES:-3b,8b}" --configs "$configs" --new-tokens "$3" \
    --out "$out/$2" 2>&1 | grep -v "Warning\|warn(" > "$out/$2/gemv_timeline.txt" || true
  echo "== $2"; grep -E "tok/s|^(qkv|o|gate\+up|down) |max" "$out/$2/gemv_timeline.txt" || tail -5 "$out/$2/gemv_timeline.txt"
}
for name in $names; do decode "$name" "$name" 256; done
case " $names " in *" m "*) decode m m_again 256 ;; esac
for name in $timelines; do decode "t_$name" "t_$name" 64; done
