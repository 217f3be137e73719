#!/usr/bin/env bash
# Issue 27's GPU check in one command (CUDA, fp16): benchmarks/gpu_profile.py on SD 1.5 at 512 px
# and SDXL at 1024 px (random weights, real architectures, base IP-Adapter, CFG batch 2): whole
# calls of 10 forwards + the deferred statistics + the export, stock / observe / swap timed with
# CUDA events (interleaved) and one torch.profiler call each (top kernels, launches per step);
# SD 1.5 also runs observe with compile=True (the deferred groups under CUDA graphs).
# Hard cap 290 s (estimate, not measured on a GPU yet).
#
# Usage: benchmarks/gpu_run.sh [OUT_DIR]     (default: benchmarks/gpu_results)
# Writes OUT_DIR/profile.json and OUT_DIR/profile.txt (the step table, then the top kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-benchmarks/gpu_results}
mkdir -p "$out_dir"
status=0
timeout --signal=INT --kill-after=10 290 \
    python benchmarks/gpu_profile.py --device cuda --dtype float16 --out-dir "$out_dir" \
    --compiled-models sd15_512 || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 130 ]; then
    echo "gpu_run.sh: stopped at the 290 s cap" >&2
fi
[ -f "$out_dir/profile.txt" ] && echo "tables: $out_dir/profile.txt"
exit "$status"
