#!/usr/bin/env bash
# The one place of the benchmarks' device plumbing: wheels, staging, GGUF parts and detached runs on
# a lent GPU machine (no network there; each call carries at most 64 MiB with the tree). Files are
# staged in $STAGE (/root/stage) over several calls, then Snakemake or a measurement runs detached
# (its own session), so it outlives the call; later `wait` calls watch it and copy what it made to $OUT.
# Here, with the package registries:
#   bash benchmarks/gpu_pipeline.sh wheels    # the wheels the machine lacks into .whl .whl2 .whl3 .whl4
#   bash benchmarks/gpu_pipeline.sh pack F    # WHEELS installed for the card's Python 3.12 into one xz tarball F
#   bash benchmarks/gpu_pipeline.sh slim      # switch to a branch without results/published, benchmarks/results
#                                             # and docs (the tree that travels: 30 MB -> 2 MB); `unslim` back
#   bash benchmarks/gpu_pipeline.sh split GGUF DIR [FIRST_CARRY...]  # GGUF in parts that each fit one call
# There, from the repository root:
#   bash benchmarks/gpu_pipeline.sh install   # carry the wheel folders WHEELS (default .whl; or a packed site)
#   bash benchmarks/gpu_pipeline.sh assets F  # carry F: a tar.xz of cache/ (zero-shot data) and resources/data
#   bash benchmarks/gpu_pipeline.sh part F [PRESET]  # carry one part F of a preset's GGUF (default smollm2),
#                                             # once per part, in name order; also while a grid runs
#   bash benchmarks/gpu_pipeline.sh start [snakemake args]   # detached Snakemake run of the DAG
#   bash benchmarks/gpu_pipeline.sh grid FILE [args]  # detached: one Snakemake run per line of FILE, in
#                                             # order (FROM=N: from its line N); batches.tsv times each line
#   bash benchmarks/gpu_pipeline.sh paper RUN [args]  # `grid` over a run of benchmarks/paper_runs.yaml,
#                                             # with its overrides, profile and arguments
#   bash benchmarks/gpu_pipeline.sh script FILE [args]  # detached: bash FILE in the staged copy (a
#                                             # measurement; it writes under $STAGE/out)
#   bash benchmarks/gpu_pipeline.sh wait SECONDS   # watch it; what it has made so far to $OUT
# `grid` is for a budget shorter than the whole job list: each line runs to its end before the next
# starts, so the time limit leaves finished cells rather than every cell half done.
# PROFILE (default profiles/gpu) and GPU_SLOTS (default 12 per visible card) choose the profile;
# PROFILE=none runs Snakemake with only the arguments given (a user's own command line, e.g. -j1).
# While Snakemake runs, every card's utilisation and memory are sampled twice a second into
# gpu_utilisation.csv; `wait` summarises it and the jobs' benchmark files (benchmarks/run_stats.py).
set -euo pipefail
STAGE=${STAGE:-/root/stage}
PY=${PYTHON:-python3}
export PYTHONPATH="$STAGE/site:$PWD/src" AQFLOW_CACHE="$STAGE/cache" PYTHONUNBUFFERED=1

carried() {  # carried NAME [GLOB]: the array NAME := the files matching GLOB (default *.whl) in the WHEELS folders
  local -n found=$1
  local file
  found=()
  for folder in ${WHEELS:-.whl}; do
    for file in "$folder"/${2:-*.whl}; do [ -f "$file" ] && found+=("$file"); done
  done
  return 0
}

# one call's carry, tree included (the device tool's limit), less a margin for what git does not list
CALL_BYTES=$(( 64 * 1024 * 1024 - 256 * 1024 ))
tree_bytes() { git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1; }

case "${1:-}" in
slim)
  [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "commit or stash your changes first" >&2; exit 1; }
  git switch -q -c device-slim
  git rm -rq results/published benchmarks/results docs
  git commit -qm "device-slim: the tree that travels to the GPU box (never merged)"
  echo "tree now $(tree_bytes) bytes; \`$0 unslim\` when the device calls are done"
  ;;
unslim)
  [ "$(git branch --show-current)" = device-slim ] || { echo "not on device-slim" >&2; exit 1; }
  git switch -q - && git branch -q -D device-slim && git branch --show-current
  ;;
wheels)
  # runtime packages missing on the machine, pure-Python needs included, as envs/requirements.txt pins
  # them: .whl the pipeline's, .whl2 transformers and tokenizers, .whl4 huggingface_hub and its HTTP
  # client, .whl3 PuLP (Snakemake's default ILP scheduler: only a -j1 run needs it). Ignored by git.
  exclude="$(git rev-parse --git-common-dir)/info/exclude"
  for pattern in /.whl/ /.whl2/ /.whl3/ /.whl4/ /.whlx/; do grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >> "$exclude"; done
  WHL=(snakemake snakemake-interface-common snakemake-interface-executor-plugins snakemake-interface-logger-plugins
       snakemake-interface-report-plugins snakemake-interface-scheduler-plugins snakemake-interface-storage-plugins
       ConfigArgParse conda-inject docutils dpath GitPython gitdb smmap humanfriendly immutables
       jsonschema jsonschema-specifications referencing rpds-py nbformat fastjsonschema jupyter_core traitlets
       platformdirs smart_open throttler yte argparse-dataclass sqlmodel SQLAlchemy greenlet pydantic pydantic_core
       annotated-types typing-inspection tenacity lm_eval datasets evaluate dill multiprocess pytablewriter
       DataProperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet nltk defusedxml more-itertools pytz
       aqlm gguf)
  BUILT=(connection_pool rouge_score sqlitedict word2number)  # published as source only: built here
  pin() { grep -iE "^${1//[-_.]/[-_.]}==" envs/requirements.txt | head -1 | grep . || { echo "no pin for $1" >&2; exit 1; }; }
  download() {  # folder, names...
    local folder=$1; shift; mkdir -p "$folder"
    for name in "$@"; do
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$folder" "$(pin "$name")" 2>&1 | grep -v "^WARNING: Location" || true
    done
  }
  download .whl "${WHL[@]}"
  for name in "${BUILT[@]}"; do "$PY" -m pip wheel -q --no-deps -w .whl "$(pin "$name")" 2>&1 | grep -v "^WARNING: Location" || true; done
  download .whl2 transformers tokenizers
  download .whl4 huggingface_hub httpx2 httpcore2 truststore
  download .whl3 PuLP
  du -sh .whl .whl2 .whl3 .whl4
  echo "then: WHEELS=\".whl .whl2 .whl4\" bash $0 pack .whlx/site.site.tar.xz (tracked tree: $(tree_bytes) bytes)"
  ;;
paper)
  # a run of benchmarks/paper_runs.yaml: its batches, overrides and arguments written out, then `grid`
  run=$2; shift 2
  mkdir -p "$STAGE/paper"
  "$PY" -c '
import sys, yaml
from pathlib import Path
run, folder = sys.argv[1], Path(sys.argv[2])
entry = yaml.safe_load(Path("benchmarks/paper_runs.yaml").read_text())["runs"][run]
(folder / f"{run}.txt").write_text("\n".join(entry["batches"]) + "\n")
(folder / f"{run}.yaml").write_text(yaml.safe_dump(entry.get("overrides", {})))
(folder / f"{run}.args").write_text(entry["profile"] + "\n" + entry.get("snakemake", "") + "\n")' "$run" "$STAGE/paper"
  { read -r profile; read -r run_args; } < "$STAGE/paper/$run.args"
  overrides=(); [ "$(cat "$STAGE/paper/$run.yaml")" = "{}" ] || overrides=(--config "overrides=$STAGE/paper/$run.yaml")
  PROFILE=${PROFILE:-$profile} bash "$0" grid "$STAGE/paper/$run.txt" $run_args "$@" "${overrides[@]}"
  ;;
split)
  # part 0 fits beside the tree and FIRST_CARRY, every later part beside the tree alone
  gguf=$2 dir=$3; shift 3
  tree=$(tree_bytes)
  extra=0; [ $# -eq 0 ] || extra=$(du -cb "$@" | tail -1 | cut -f1)
  first=$(( CALL_BYTES - tree - extra ))
  rest=$(( CALL_BYTES - tree ))
  [ "$first" -gt 0 ] || { echo "no room beside the tree ($tree bytes) and $*" >&2; exit 1; }
  mkdir -p "$dir"
  head -c "$first" "$gguf" > "$dir/part.00"
  tail -c +"$((first + 1))" "$gguf" | split -b "$rest" -d -a 2 --numeric-suffixes=1 - "$dir/part."
  ls -la "$dir"; echo "$(ls "$dir" | wc -l) parts for a $tree-byte tree: one \`part\` call each, in name order"
  ;;
pack)
  site=$(mktemp -d)
  carried wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" --python-version 3.12 \
    --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 "${wheels[@]}"
  mkdir -p "$(dirname "$2")"
  tar -cf - -C "$site" . | xz -6 -T0 > "$2.tmp" && mv "$2.tmp" "$2"
  rm -rf "$site"; ls -la "$2"
  ;;
install)
  carried packs '*.site.tar.xz'
  for pack in "${packs[@]}"; do mkdir -p "$STAGE/site" && tar -xJf "$pack" -C "$STAGE/site"; done
  carried wheels
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" "${wheels[@]}"
  fi
  "$PY" -c "import snakemake, aqlm, lm_eval, datasets, gguf, matplotlib, torch, transformers; \
print('snakemake', snakemake.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  # Bytecode for the staged packages and the card's own Python (pip ran with --no-compile, and a
  # process that finds no .pyc compiles every module it imports: ~1,500 modules, 8 s of an
  # evaluation under cProfile on an H100 box); compileall skips files already compiled.
  echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
  "$PY" -m compileall -q -j 0 "$STAGE/site" \
    $("$PY" -c "import os, torch, transformers, triton; print(' '.join(os.path.dirname(m.__file__) for m in (torch, transformers, triton)))") \
    > /dev/null || true
  # aqlm compiles its CUDA kernels on first use (minutes): start that now, in its own session
  # so it outlives this call and the evaluation later finds them built.
  setsid nohup "$PY" -c "import aqlm.inference_kernels.cuda_kernel" > "$STAGE/aqlm_build.log" 2>&1 < /dev/null &
  ;;
assets)
  tar -xJf "$2" -C "$STAGE" && ls "$STAGE/cache" "$STAGE/resources/data" | head -40
  ;;
part)
  mkdir -p "$STAGE/parts/${3:-smollm2}" && cp "$2" "$STAGE/parts/${3:-smollm2}/" && ls -la "$STAGE/parts/${3:-smollm2}"
  ;;
join)
  # each preset's parts joined into the file the pipeline's fetch_model looks for, once their join
  # has the preset's sha256 (fetch_model checks it again when it reads it); a preset whose parts
  # are not all staged yet is left for a later join: `grid` joins before every line, so parts
  # staged while earlier lines run are there for the lines that need them
  for parts in "$STAGE"/parts/*/; do
    [ -d "$parts" ] || continue
    preset=$(basename "$parts")
    gguf="$STAGE/cache/$preset/$("$PY" -c "import sys; from aqflow.models.presets import get_preset; print(get_preset(sys.argv[1]).gguf_name)" "$preset")"
    [ -f "$gguf" ] && continue  # joined and checked by an earlier join
    mkdir -p "$(dirname "$gguf")"
    cat "$parts"* > "$gguf.tmp"
    if "$PY" -c "import sys; from aqflow.models.presets import get_preset; from aqflow.io.artifacts import file_sha256; \
sys.exit(file_sha256(sys.argv[2]) != get_preset(sys.argv[1]).sha256)" "$preset" "$gguf.tmp"; then
      mv "$gguf.tmp" "$gguf"; echo "$gguf: sha256 OK"
    else
      rm -f "$gguf.tmp"; echo "$preset: $(ls "$parts" | wc -l) part(s) staged, not all of them yet"
    fi
  done
  ;;
start|grid|script)
  # Snakemake runs detached (its own session) in a copy outside the synced checkout, so that it
  # outlives this call and keeps its outputs between calls: the device tool replaces the
  # checkout's unignored files (results/published is committed) at every call, and a job killed at a
  # call's time limit would restart from scratch. Later `wait` calls watch it.
  bash "$0" join
  mode=$1; shift
  # an earlier run's exit status would end the next `wait` at once
  rm -f "$STAGE/snakemake.rc" "$STAGE/script.sh"
  if [ "$mode" = grid ]; then tail -n +"${FROM:-1}" "$1" > "$STAGE/batches.txt"; shift; fi
  if [ "$mode" = script ]; then cp "$1" "$STAGE/script.sh"; shift; fi
  mkdir -p "$STAGE/work"
  tar --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs \
      --exclude=./.whl --exclude=./.whl2 --exclude=./.device-carry --exclude=./.git --exclude=./.venv -cf - . | tar -C "$STAGE/work" -xf -
  cd "$STAGE/work"
  export PYTHONPATH="$STAGE/site:$PWD/src"
  "$PY" -m compileall -q -j 0 src > /dev/null || true
  # the stand-in corpora staged by `assets`, if any (a hub-text run, benchmarks/headline_gpu.sh, has none)
  mkdir -p resources && { [ -d resources/data ] || [ ! -d "$STAGE/resources/data" ] || cp -r "$STAGE/resources/data" resources/; }
  cat "$STAGE/aqlm_build.log" || true
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  date +%s > "$STAGE/started_at"
  profile=${PROFILE:-profiles/gpu}
  cards=$( (nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true) | wc -l)
  slots=${GPU_SLOTS:-$(( 12 * cards ))}
  if [ "$mode" != script ]; then  # a measurement samples the card itself if it needs to
    setsid nohup nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,nounits -lms 500 \
      > "$STAGE/gpu_utilisation.csv" 2>/dev/null < /dev/null &
    echo $! > "$STAGE/sampler.pid"
  fi
  smk=("$PY" -m snakemake --profile "$profile" --resources gpu="$slots" --scheduler greedy --keep-going)
  # PROFILE=none: Snakemake with only the arguments given (a user's own command line, e.g. -j1)
  [ "$profile" = none ] && smk=("$PY" -m snakemake)
  if [ "$mode" = script ]; then
    mkdir -p "$STAGE/out"
    setsid nohup bash -c 'bash "$@"; echo $? > "'"$STAGE"'/snakemake.rc"' run "$STAGE/script.sh" "$@" \
      > "$STAGE/snakemake.out" 2>&1 < /dev/null &
  elif [ "$mode" = start ]; then
    setsid nohup bash -c '"$@"; echo $? > "'"$STAGE"'/snakemake.rc"; kill $(cat "'"$STAGE"'/sampler.pid")' \
      run "${smk[@]}" "$@" > "$STAGE/snakemake.out" 2>&1 < /dev/null &
  else
    # one Snakemake run per line; `all` (or an empty line) is the default target
    setsid nohup bash -c '
      stage=$1; extra=$2; shift 2
      printf "batch\tstart\tend\trc\ttargets\n" > "$stage/batches.tsv"
      n=0
      while IFS= read -r line; do
        n=$((n + 1)); targets=${line:-all}; begin=$(date +%s)
        bash benchmarks/gpu_pipeline.sh join
        echo "=== batch $n: $targets"
        "$@" $targets $extra < /dev/null; rc=$?
        printf "%s\t%s\t%s\t%s\t%s\n" "$n" "$begin" "$(date +%s)" "$rc" "$targets" >> "$stage/batches.tsv"
      done < "$stage/batches.txt"
      echo 0 > "$stage/snakemake.rc"; kill $(cat "$stage/sampler.pid")' \
      run "$STAGE" "$*" "${smk[@]}" > "$STAGE/snakemake.out" 2>&1 < /dev/null &
  fi
  echo $! > "$STAGE/snakemake.pid"
  echo "snakemake started ($mode, pid $(cat "$STAGE/snakemake.pid"), $profile, gpu=$slots over $cards card(s))"
  ;;
wait)
  # Watch the detached run for at most SECONDS, then copy what it has produced so far to $OUT.
  deadline=$(( $(date +%s) + $2 ))
  while [ ! -f "$STAGE/snakemake.rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do
    sleep 15
    echo "$(( $(date +%s) - $(cat "$STAGE/started_at") )) s: $(grep -E '^[0-9]+ of [0-9]+ steps' "$STAGE/snakemake.out" | tail -1)"
  done
  if [ -f "$STAGE/snakemake.rc" ]; then echo "snakemake exit status $(cat "$STAGE/snakemake.rc")"; else echo "snakemake still running"; fi
  if [ -f "$STAGE/script.sh" ]; then  # a measurement: its own output folder and the tail of its log
    cp -r "$STAGE/out/." "$OUT/" 2>/dev/null || true
    tail -c 6000 "$STAGE/snakemake.out"
    exit 0
  fi
  cp "$STAGE/batches.tsv" "$OUT/" 2>/dev/null && cat "$STAGE/batches.tsv"
  grep -E "^Error in rule|^WorkflowError|Exiting because" "$STAGE/snakemake.out" || true
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true
  cd "$STAGE/work"
  cp .snakemake/log/*.snakemake.log "$STAGE/" 2>/dev/null || true
  { "$PY" -m benchmarks.run_stats stages logs/benchmarks --json "$OUT/stage_times.json" | tee "$OUT/stage_times.txt"; } || true
  mkdir -p results; find results -name '*.json' -o -name '*.csv' -o -name '*.parquet' -o -name '*.png' | grep -v '/model/' \
    | tar -czf "$OUT/results.tar.gz" -T -
  cp "$STAGE/gpu_utilisation.csv" "$OUT/" 2>/dev/null || true
  { "$PY" -m benchmarks.run_stats cards "$STAGE/gpu_utilisation.csv" logs/benchmarks --json "$OUT/gpu_utilisation.json" \
      | tee "$OUT/gpu_utilisation.txt"; } 2>/dev/null || true
  tar -czf "$OUT/logs.tar.gz" logs "$STAGE"/*.snakemake.log "$STAGE/snakemake.out" 2>/dev/null || true
  ls -la "$OUT"
  ;;
*)  # -h, --help, or no command: the usage at the top of this file
  sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-; [ "${1:-}" = -h ] || [ "${1:-}" = --help ]
  ;;
esac
