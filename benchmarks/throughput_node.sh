#!/usr/bin/env bash
# One device call on a node of several GPUs (4 x H100 here), from the repository root:
#   OUT=... bash benchmarks/throughput_node.sh
# 1. At once, one job per card: the CUDA-graph V-step test; PV-tuning after this branch's changes
#    with the V-step replayed as a CUDA graph vs run eagerly, at the SmolLM2 (cards 0, 1) and
#    Llama-3.2-3B (cards 2, 3) shapes (same inputs, same steps as throughput.py's single-card runs).
# 2. PV-tuning of the 3B shape data-parallel over all cards (torchrun), batch 32.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORK=${WORK:-/root/node}
cards=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
tp="timeout 150 python3 benchmarks/throughput.py pv --before src --after src --variants after"
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_pvtune.py -k cuda_graph > "$OUT/graph_test.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0 $tp --shape smollm2 --work $WORK/graph --out "$OUT/vstep_smollm2_graph.json" > "$WORK.s0.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 $tp --shape smollm2 --work $WORK/eager --out "$OUT/vstep_smollm2_eager.json" --after-flags=--no-v-step-graph > "$WORK.s1.log" 2>&1 &
CUDA_VISIBLE_DEVICES=2 $tp --shape llama3b --work $WORK/graph --out "$OUT/vstep_llama3b_graph.json" > "$WORK.l2.log" 2>&1 &
CUDA_VISIBLE_DEVICES=3 $tp --shape llama3b --work $WORK/eager --out "$OUT/vstep_llama3b_eager.json" --after-flags=--no-v-step-graph > "$WORK.l3.log" 2>&1 &
wait
tail -1 "$OUT/graph_test.log"
for log in "$WORK".s0.log "$WORK".s1.log "$WORK".l2.log "$WORK".l3.log; do grep -E "tokens/s|Error|error" "$log" | tail -2; done
timeout 120 ${tp#timeout 150 } --shape llama3b --work $WORK/graph --reuse --processes "$cards" --run 32 5 4 5 \
    --out "$OUT/pv_llama3b_x${cards}.json" > "$WORK.multi.log" 2>&1
grep -E "tokens/s|Error|error" "$WORK.multi.log" | tail -3
