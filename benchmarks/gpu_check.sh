#!/usr/bin/env bash
# The one-command GPU check: kernel parity tests, offload on CUDA, activation offload, kernel benchmarks, zero2 steps
# (and their fp16 skips on the host against on the device).
# Installs nothing (the GPU machine has torch, CuPy, Lightning and pytest). Writes a Markdown report to
# $OUT (the device tool's output folder) or benchmarks/results/. `--dry-run` runs the same steps on the
# CPU, where the GPU tests skip and the benchmark only exercises its code paths.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dry=""; accelerator=gpu
if [ "${1:-}" = "--dry-run" ]; then dry="--dry-run"; accelerator=cpu; fi
out_dir=${OUT:-benchmarks/results}
mkdir -p "$out_dir"
report="$out_dir/gpu_check_$(date +%F).md"
status=0
run() {  # run TITLE COMMAND...: appends the command's output to the report
  local title=$1; shift
  { echo; echo "## $title"; echo; echo '```'; echo "\$ $*"; } >> "$report"
  timeout 240 "$@" >> "$report" 2>&1 || { echo "(exit status $?)" >> "$report"; status=1; }
  echo '```' >> "$report"
}
{
  echo "# GPU check $(date -u +'%F %H:%M') UTC ${dry:+(DRY RUN on the CPU)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
  python3 -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null || echo "no CuPy"
} > "$report"
run "Kernel parity tests" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py
run "ZeRO-Offload, the fused ZeRO step and fp16 skips on the device, on CUDA" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_offload_gpu.py
run "Activation checkpointing: offload to pinned host memory on a side stream" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_activations_gpu.py
run "sync_batchnorm on CUDA under zero2 and zero3" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sync_batchnorm_gpu.py
run "Kernel benchmarks" python3 benchmarks/bench_kernels.py $dry --out "$out_dir/kernels_$(date +%F).md"
if [ -n "$dry" ]; then acts="--device cpu --layers 4 --seq 256 --base 128 --rounds 2 --out $out_dir/activations_dry_run.md"
else acts="--device cuda --layers 16 --embd 512 --seq 8192 --base 2048 --rounds 5 --out $out_dir/activations_gpu_$(date +%F).md"
  acts="$acts --trace $out_dir/activation_offload_trace.json"; fi
run "Activation checkpointing: memory, longest sequence, offload's step time" python3 benchmarks/activations.py $acts
run "zero2 training steps" python3 benchmarks/train_step.py --accelerator $accelerator --steps 40
run "zero2 training steps, fused block" python3 benchmarks/train_step.py --accelerator $accelerator --steps 40 --fused
run "zero2 fp16: overflowed steps skipped on the host vs on the device" python3 benchmarks/train_step.py \
  --accelerator $accelerator --steps 40 --compare-fp16-skips 3 ${dry:+--small}
cat "$report"
exit $status
