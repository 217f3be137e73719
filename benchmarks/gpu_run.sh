#!/usr/bin/env bash
# The GPU benchmark set of issue 13 on one CUDA GPU, fp16: SD 1.5 UNet step at 512 px and SDXL at
# 1024 px (random weights, real architectures, base IP-Adapter, CFG batch 2) with stock / observe /
# observe compiled / swap; the SD 1.5 attn2 layers; the NW field with its GEMM roofline.
# Sized for one H200 (estimate 2-5 min, not measured yet); hard cap 470 s. run.py rewrites the JSON
# and the tables after every section, so a run cut by the cap keeps every finished section.
#
# Usage: benchmarks/gpu_run.sh [OUT_DIR]     (default: benchmarks/gpu_results)
# Writes OUT_DIR/gpu_fp16.json (every repeat, machine info) and OUT_DIR/gpu_fp16.txt (the tables).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-benchmarks/gpu_results}
mkdir -p "$out_dir"
status=0
timeout --signal=INT --kill-after=10 470 \
    python benchmarks/run.py --device cuda --dtype float16 \
    --out "$out_dir/gpu_fp16.json" --tables "$out_dir/gpu_fp16.txt" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 130 ]; then
    echo "gpu_run.sh: stopped at the 470 s cap; $out_dir holds the sections that finished" >&2
fi
[ -f "$out_dir/gpu_fp16.txt" ] && echo "tables: $out_dir/gpu_fp16.txt"
exit "$status"
