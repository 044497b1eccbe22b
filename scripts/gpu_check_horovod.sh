#!/usr/bin/env bash
# make gpu-check-horovod: the PyTorch adapter's CUDA path under horovodrun, on a GPU machine that has
# what `make gpu-check` needs (nvcc, a CUDA build of torch) and CMake, but no Horovod, TensorFlow, MPI
# or network. Horovod's source distribution travels with the working tree: `make gpu-carry` (on a
# machine with network) puts it in .gpu_carry/, an ignored folder to carry.
#   1. builds the CPU and CUDA libraries for this GPU (in place);
#   2. builds Horovod with PyTorch and Gloo from the carried source (scripts/build_horovod.sh,
#      HVD_QSGD_HOROVOD_FRAMEWORKS=torch) and installs it in a folder of its own;
#   3. runs tests/mp/torch_device_path.py on 2 Gloo ranks sharing the GPU: for every configuration,
#      three optimizer steps on the device path equal to the host path bit for bit (results, worker
#      and server residuals), with no host fallback.
# Writes gpu_check_horovod.md and the logs under $OUT (default ./gpu_check_out).
#
# GPU_CHECK_DEVICE=emulated runs the same steps on a machine without a GPU, with the CUDA library
# emulated on the host (tests/emulated_cuda.py): a check of this script, not of a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
. scripts/versions.sh
SDIST=${HVD_QSGD_HOROVOD_SDIST:-$PWD/.gpu_carry/horovod-$HOROVOD_VERSION.tar.gz}
SITE=$(mktemp -d)
export PYTHONUNBUFFERED=1 HVD_QSGD_WITHOUT_TENSORFLOW=1 OMP_NUM_THREADS=1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$OUT/gpu_check_horovod.md"
fail=0

. scripts/gpu_check_steps.sh

case "$DEVICE" in
  cuda)
    arch=$(cuda_arch gpu-check-horovod) || exit 2
    build=(build_for_gpu "$arch") ;;
  emulated)
    export HVD_QSGD_EMULATED_CUDA_LIB="$SITE/libqsgd_cuda_emu.so"
    build=($PY -c "from tests import emulated_cuda; emulated_cuda.build('$SITE')") ;;
  *) echo "gpu-check-horovod: GPU_CHECK_DEVICE must be cuda or emulated, got $DEVICE"; exit 2 ;;
esac
[ -f "$SDIST" ] || { echo "gpu-check-horovod: no Horovod source distribution at $SDIST (run make gpu-carry where there is network, and carry .gpu_carry)"; exit 2; }
{
  echo "# gpu-check-horovod ($DEVICE), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "- torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  echo
  steps_table_head
} >"$summary"

step build "${build[@]}"
install_horovod() {
  local wheel
  install_carried_cffi "$SITE" "$(dirname "$SDIST")" || return 1
  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and this check runs its 2 ranks on
  # one: build without NCCL unless told otherwise (HVD_QSGD_HOROVOD_NCCL=auto on a machine of 2+ GPUs)
  wheel=$(HVD_QSGD_HOROVOD_NCCL="${HVD_QSGD_HOROVOD_NCCL:-0}" HVD_QSGD_HOROVOD_FRAMEWORKS=torch HVD_QSGD_HOROVOD_SDIST="$SDIST" HVD_QSGD_CACHE="${HVD_QSGD_CACHE:-$SITE/cache}" \
          bash scripts/build_horovod.sh "$PY") || return 1
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel"
}
step horovod install_horovod
step adapter $PY "$SITE/bin/horovodrun" -np 2 -H localhost:2 --gloo \
  $PY tests/mp/torch_device_path.py "$DEVICE" all
ok=$(grep -c "<stdout>:OK " "$OUT/adapter.log" 2>/dev/null || true)
{
  echo
  echo "OK lines (2 ranks x every configuration): $ok"
} >>"$summary"
cat "$summary"
rm -rf "$SITE"
exit $fail
