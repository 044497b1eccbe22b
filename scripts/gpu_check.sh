#!/usr/bin/env bash
# make gpu-check: the CUDA path on a real GPU, in one command. Needs nvcc, compute-sanitizer and a
# CUDA build of torch (plus numpy and pytest); no Horovod, TensorFlow or network.
#   1. builds the CPU and CUDA libraries for this GPU (in place),
#   2. runs the CUDA tests against the device (a skipped GPU test fails the check),
#   3. runs compute-sanitizer memcheck and racecheck over every kernel (scripts/gpu_sanitize.py),
#   4. runs the kernel benchmark (python -m benchmarks kernels --device cuda; encoders 2 and 1 side by
#      side) and, where ncu is, counts the encoders' and decoder's instructions at 64M elements, 4 bits,
# and writes gpu_check.md (the summary), the logs and kernels.json under $OUT (default ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SIZES=${GPU_CHECK_SIZES:-1M,16M,64M,256M}
export PYTHONUNBUFFERED=1 HVD_QSGD_WITHOUT_TENSORFLOW=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$OUT/gpu_check.md"
fail=0

. scripts/gpu_check_steps.sh

arch=$(cuda_arch gpu-check) || exit 2
{
  echo "# gpu-check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "- nvcc: $(nvcc --version | tail -1); compute capability $arch"
  echo "- torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)'); kernels/qsgd_cuda.cu sha1 $(sha1sum kernels/qsgd_cuda.cu | cut -c1-12)"
  echo
  steps_table_head
} >"$summary"

step build build_for_gpu "$arch"
step tests env HVD_QSGD_REQUIRE_GPU=1 $PY -m pytest -q -rs -p no:cacheprovider -k "not emulated" tests/test_cuda.py
for tool in memcheck racecheck; do
  step "sanitize_$tool" timeout "${GPU_CHECK_SANITIZE_S:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
    $PY scripts/gpu_sanitize.py
done
step bench $PY -m benchmarks kernels --device cuda --sizes "$SIZES" --bits 2,4,8 --encoder 2,1 --json "$OUT/kernels.json"
# instructions per element of the encoders, version 2 against version 1 (ncu, where the machine has it)
if command -v ncu >/dev/null; then
  for enc in 2 1; do
    step "ncu_encoder$enc" timeout 120 ncu --kernel-name regex:'encode_buckets|decode_sum_kernel|checksum_kernel' --metrics \
      smsp__inst_executed.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      $PY scripts/gpu_profile.py $((64 << 20)) 4 512 "$enc"
  done
  # what limits the version-2 encoder: one launch, the scheduler's and the warps' view and the hot SASS
  step ncu_detail timeout 120 ncu --kernel-name regex:encode_buckets_kernel --launch-count 1 --section SpeedOfLight \
    --section InstructionStats --section WarpStateStats --section SchedulerStats --section SourceCounters \
    $PY scripts/gpu_profile.py $((64 << 20)) 4 512 2
fi
if command -v cuobjdump >/dev/null; then  # the encoder's SASS (4 bits, float32, no error feedback)
  step sass bash -c 'cuobjdump -sass hvd_qsgd/_lib_cuda*.so | awk "/Function : .*encode_buckets_kernelILi4ELb0EfLb0E/{p=1} p&&/Function : /&&!/encode_buckets_kernelILi4ELb0EfLb0E/{p=0} p"'
fi
{
  echo
  echo '## kernel benchmark'
  echo '```'
  sed -n '/^CUDA:/,$p' "$OUT/bench.log"
  echo '```'
} >>"$summary"
cat "$summary"
exit $fail
