#!/usr/bin/env bash
# One device call on a Hopper card (issue 27): the CUDA kernels' GPU tests, every candidate of a shape
# timed in CUDA graphs (benchmarks/lut_kernel_profile.py), then Nsight Compute's counters of four
# launches (the split-K and the cluster kernel on q+k+v and on gate+up). SHAPE (3b or 8b, default 3b) picks
# the model shape and LAUNCHES (LINEAR=CONFIG ..., default those four at 3B) the launches profiled, e.g.
#   SHAPE=8b LAUNCHES="gate+up (fused)=cuda_lut16:o1024g64s8w8|down_proj=cuda_lut16:o512g64s28w8"
# ('|' between launches). Run from the repository root:
#   bash benchmarks/lut_kernel_check.sh OUT_DIR
# Writes OUT_DIR/{tests.log, lut_kernel_profile.json, lut_kernel_profile.txt, ncu.txt}; prints the
# tests' summary, the timing tables and the counters' key lines.
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_cuda_kernels.py > "$out/tests.log" 2>&1
grep -E "^E  .*(element|Error)|FAILED|passed|failed" "$out/tests.log" | head -20
shape=${SHAPE:-3b}
launches=${LAUNCHES:-"qkv (fused)=cuda_lut16:o256g32s12w8|qkv (fused)=cuda_cluster16:o256g48s8w8|gate+up (fused)=cuda_lut32:o768g32s12w8|gate+up (fused)=cuda_cluster32:o256g48s8w8"}
IFS='|' read -r -a launch_list <<< "$launches"
timeout 240 "$PY" benchmarks/lut_kernel_profile.py --shape "$shape" --out "$out/lut_kernel_profile.json" \
  > "$out/lut_kernel_profile.txt" 2>&1
cat "$out/lut_kernel_profile.txt"
timeout 200 ncu --clock-control none -k regex:lut_gemv --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters \
  --print-details all \
  "$PY" benchmarks/lut_kernel_profile.py --shape "$shape" --launch-only "${launch_list[@]}" > "$out/ncu.txt" 2>&1
grep -E "lut_gemv_2x8|Duration|Elapsed Cycles|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|stalled_(long_scoreboard|short_scoreboard|barrier|mio_throttle|wait|lg_throttle|math_pipe|membar|not_selected|selected|no_instruction|dispatch|tex|drain|sleeping|branch)|Executed Ipc A|Block Limit|Waves Per SM" "$out/ncu.txt" | head -150
