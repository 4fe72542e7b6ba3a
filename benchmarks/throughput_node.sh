#!/usr/bin/env bash
# PV-tuning on one node of several GPUs, one device call, from the repository root:
#   OUT=... bash benchmarks/throughput_node.sh          (WORK=/root/node by default)
# 1. the Llama-3.2-3B shape at the paper's batch (32 windows of 4096 tokens) on 1, 2 and every
#    card of the node (torchrun, the state sharded on FSDP2), the same inputs and steps each time;
# 2. the Llama-3.1-8B shape on 2 cards (each holds its share of the state, no host offload);
# 3. node_<cards>x<card>.json: scaling efficiency, the paper budget projected, the 8B step and peak
#    (`throughput.py node`). The whole DAG on the node: benchmarks/headline_gpu.sh with
#    profiles/gpu-node, and `python -m benchmarks.run_stats` for its per-rule and per-card costs.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORK=${WORK:-/root/node}
cards=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
pv="python3 benchmarks/throughput.py pv --before src --after src --variants after --work $WORK"
reports=()
for n in $(printf '%s\n' 1 2 "$cards" | sort -nu); do
    $pv --shape llama3b --processes "$n" --run 32 4 32 4 $([ "$n" = 1 ] || echo --reuse) \
        --out "$OUT/pv_llama3b_x$n.json" > "$WORK.3b_x$n.log" 2>&1
    grep -E "tokens/s|Error" "$WORK.3b_x$n.log" | tail -2
    reports+=("$OUT/pv_llama3b_x$n.json")
done
$pv --shape llama8b --processes 2 --run 32 3 16 1000 --out "$OUT/pv_llama8b_x2.json" > "$WORK.8b_x2.log" 2>&1
grep -E "tokens/s|Error" "$WORK.8b_x2.log" | tail -2
python3 benchmarks/throughput.py node "${reports[@]}" --pv8b "$OUT/pv_llama8b_x2.json" --out "$OUT"
