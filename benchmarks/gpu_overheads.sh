#!/usr/bin/env bash
# Issue 11's start-up and evaluation measurements on one card, in one detached run (started by
# `benchmarks/gpu_pipeline.sh script benchmarks/gpu_overheads.sh BEFORE_SRC` after `install`,
# the SmolLM2 GGUF parts and `assets`; BEFORE_SRC: a copy of the baseline's src/, e.g. 423e9cc's).
# Writes under $STAGE/out, which `gpu_pipeline.sh wait` returns:
#   layer_job_overhead.json  a layer job's phases, one process at a time (+ the first use of the
#                            card's kernels: the quantization called again in the same process)
#   eval_speed.json          a whole SmolLM2 evaluation, baseline tree against this one
#   eval_after.prof.txt      where the time of this tree's evaluation goes (cProfile, by own time)
set -x
STAGE=${STAGE:-/root/stage}
OUTDIR="$STAGE/out"
BEFORE=$1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 SITE="$STAGE/site"
mkdir -p "$OUTDIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/card.txt"
PYTHONPATH="src:$SITE" python3 -c "import torch, transformers, tokenizers, lm_eval
print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)" \
  | tee -a "$OUTDIR/card.txt"

# the fp16 model folder, as the pipeline's fetch_model makes it
python3 -m snakemake resources/models/smollm2 --profile profiles/gpu --resources gpu=12 || exit 1
MODEL="$PWD/resources/models/smollm2"  # absolute: the layer jobs run in their own folders

python3 benchmarks/layer_job_overhead.py --device cuda --model-dir "$MODEL" --repeats 5 --snakemake --warm-workers \
  --work /root/ljo --json "$OUTDIR/layer_job_overhead.json"

# six tasks + both perplexities, the baseline first; 512 requests a batch (the fastest setting measured)
python3 benchmarks/eval_speed.py run --before "$BEFORE" --after src --model "fp=$MODEL" \
  --data-dir resources/data --task-data-dir "$AQFLOW_CACHE/zero-shot" --task-batch-size 512 \
  --work /root/es --out "$OUTDIR/eval_speed.json"

# the same evaluation of this tree under cProfile: what its time is spent on
# (the stage's main inside cProfile.run: `python -m aqflow` ends with os._exit, before a profile is written)
PYTHONPATH="src:$SITE" python3 -c "
import cProfile, sys
from aqflow.stages import evaluate
cProfile.run('evaluate.main(sys.argv[1:])', '/root/eval_after.prof')" --model-dir "$MODEL" \
  --output /root/eval_profiled.json --domain wikitext2-standin joined resources/data/wikitext2-standin.parquet \
  --domain c4-standin sampled resources/data/c4-standin.parquet --task-data-dir "$AQFLOW_CACHE/zero-shot" \
  --batch-size 32 --task-batch-size 512 --quiet
python3 -c "
import pstats, sys
stats = pstats.Stats('/root/eval_after.prof', stream=sys.stdout)
stats.sort_stats('tottime').print_stats(45)
stats.sort_stats('cumulative').print_stats(45)" > "$OUTDIR/eval_after.prof.txt"
python3 -c "import json; print(json.dumps(json.load(open('/root/eval_profiled.json'))['timings'], indent=1))" \
  >> "$OUTDIR/eval_after.prof.txt"
echo done
