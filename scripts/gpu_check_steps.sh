# Sourced by scripts/gpu_check.sh and scripts/gpu_check_horovod.sh: what their steps share. The caller
# sets OUT (the output folder), PY (the Python with a CUDA build of torch), summary (its summary file)
# and fail=0.

step() {  # step NAME CMD...: run, log to $OUT/NAME.log, record ok/FAILED and the seconds it took
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "| $name | ok | $((SECONDS - t0)) s |" >>"$summary"
  else
    echo "| $name | FAILED (rc $?) | $((SECONDS - t0)) s |" >>"$summary"
    fail=1
  fi
  tail -n 25 "$OUT/$name.log"
}

cuda_arch() {  # cuda_arch CHECK: the visible GPU's compute capability (e.g. 90); exits 2 without one
  $PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')" || {
    echo "$1: torch sees no CUDA device" >&2; exit 2; }
}

build_for_gpu() {  # build_for_gpu ARCH: the CPU and CUDA libraries, in place, for that compute capability
  # GPU_CHECK_REUSE_BUILD=1: keep the libraries an earlier check of this session built for this Python
  if [ "${GPU_CHECK_REUSE_BUILD:-0}" = 1 ] && ls hvd_qsgd/_lib_cuda"$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" >/dev/null 2>&1; then
    echo "reusing the libraries built earlier in this session"; return 0
  fi
  env HVD_QSGD_WITH_CUDA=1 HVD_QSGD_CUDA_ARCHS="$1" $PY setup.py -q build_ext --inplace
}

install_carried_cffi() {  # install_carried_cffi DIR WHEELS: cffi and pycparser from the carried wheels
  # in WHEELS (make gpu-carry) into DIR, where $PY lacks cffi (Horovod's PyTorch build needs it)
  $PY -c 'import cffi' 2>/dev/null && return 0
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$1" "$2"/cffi-*.whl "$2"/pycparser-*.whl
}

steps_table_head() {
  echo "| step | result | time |"
  echo "|---|---|---|"
}
