#!/usr/bin/env bash
# The GPU issue's steps in one call of the device machine, within a deadline (docs/gpu.md):
#   check    make gpu-check (CUDA tests, compute-sanitizer, kernel table), while Horovod (PyTorch +
#            Gloo) builds from the carried sdist (.gpu_carry/) in the background;
#   horovod  make gpu-check-horovod (the adapter's device path against its host path on 2 ranks),
#            then Horovod installed into this Python's environment, so horovodrun is beside it;
#   overhead python -m benchmarks overhead --calls, CUDA gradients then CPU ones: a gradient's host
#            cost per call, one process (at most OVERHEAD_S seconds, default 120);
#   train    python -m benchmarks convergence --workload lm --device cuda: ranks sharing the GPU, over
#            links shaped to $LM_RATE where network namespaces can be made, otherwise over loopback
#            (and then said so).
# A phase already done on this (warm) machine is skipped, so a second call goes on where the first
# stopped: GPU_SESSION_PHASES=train LM_SEEDS=2 bash scripts/gpu_session.sh.
# Everything is written under $GPU_SESSION_WORK (default /tmp/gpu_session); what comes back ($OUT,
# at most 8 files) is results.tar.gz of its logs and results, packed after every phase, plus the summaries.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-$PWD/gpu_session_out}
WORK=${GPU_SESSION_WORK:-/tmp/gpu_session}
DEADLINE=$((SECONDS + ${GPU_SESSION_S:-560}))
PHASES=${GPU_SESSION_PHASES:-check,horovod,overhead,train}
PY=$(command -v "${PYTHON:-python3}")
mkdir -p "$RESULTS" "$WORK/out"
export PYTHONUNBUFFERED=1 HVD_QSGD_WITHOUT_TENSORFLOW=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export HVD_QSGD_CACHE="$WORK/cache" HVD_QSGD_HOROVOD_SDIST=${HVD_QSGD_HOROVOD_SDIST:-$PWD/.gpu_carry/horovod-0.28.1.tar.gz}
SITE="$WORK/site"  # what this script installs where $PY's environment is not writable, first on the paths
export PATH="$SITE/bin:$PATH" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
. scripts/gpu_check_steps.sh
log() { echo "[gpu_session $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$WORK/out/session.log"; }
left() { echo $((DEADLINE - SECONDS)); }
pack() {
  # the logs, tables and JSON only: with the training runs' folders (their saved parameters) the
  # archive grew past what the device tool brings back (2026-11-27), and nothing came back
  tar -czf "$RESULTS/results.tar.gz" -C "$WORK" --exclude='*.whl' --exclude='*.pt' out
  cp "$WORK/out/session.log" "$RESULTS/" 2>/dev/null
  for f in check/gpu_check.md horovod/gpu_check_horovod.md overhead/calls_cuda.md train/lm_table.md; do
    [ -f "$WORK/out/$f" ] && cp "$WORK/out/$f" "$RESULTS/"
  done
  return 0
}
has() { case ",$PHASES," in *",$1,"*) return 0 ;; esac; return 1; }

if [ ! -f "$WORK/out/machine.txt" ]; then
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    echo "nproc $(nproc); $(grep -m1 'model name' /proc/cpuinfo)"
    $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    nvcc --version | tail -1
    for t in ip tc compute-sanitizer ncu cmake; do echo "$t: $(command -v $t || echo missing)"; done
  } >"$WORK/out/machine.txt" 2>&1
fi
log "phases $PHASES; $(left) s to the deadline; $(head -1 "$WORK/out/machine.txt")"

# Horovod, in the background from the start (the wheel is cached under $HVD_QSGD_CACHE); its PyTorch
# extension's build needs cffi, carried as wheels (make gpu-carry) where the machine has none
HVD_LOG="$WORK/out/horovod_build.log"
install_carried_cffi "$SITE" "$(dirname "$HVD_QSGD_HOROVOD_SDIST")" >"$WORK/out/cffi.log" 2>&1
log "cffi: $($PY -c 'import cffi; print(cffi.__version__)' 2>&1 | tail -1)"
if ! ls "$WORK"/horovod.whl.path >/dev/null 2>&1 && { has horovod || has train; }; then
  ( HVD_QSGD_HOROVOD_NCCL=0 HVD_QSGD_HOROVOD_FRAMEWORKS=torch bash scripts/build_horovod.sh "$PY" \
      >"$WORK/horovod.whl.tmp" 2>"$HVD_LOG" && mv "$WORK/horovod.whl.tmp" "$WORK/horovod.whl.path" ) &
  HVD_PID=$!
  log "Horovod build started (pid $HVD_PID)"
fi

if has check && [ ! -f "$WORK/check.done" ]; then
  log "make gpu-check"
  OUT="$WORK/out/check" GPU_CHECK_SANITIZE_S=150 bash scripts/gpu_check.sh >"$WORK/out/check.log" 2>&1
  log "gpu-check exit $?"; touch "$WORK/check.done"; pack
fi

if ! has check && [ ! -f "$WORK/built" ]; then  # the libraries, as gpu-check builds them
  arch=$($PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
  HVD_QSGD_WITH_CUDA=1 HVD_QSGD_CUDA_ARCHS="$arch" $PY setup.py -q build_ext --inplace >"$WORK/out/build.log" 2>&1
  log "libraries built for sm_$arch: exit $?"
fi
touch "$WORK/built"

if { has horovod || has train; } && [ -n "${HVD_PID:-}" ]; then
  log "waiting for the Horovod build"
  wait "$HVD_PID"; log "Horovod build exit $? ($(cat "$WORK/horovod.whl.path" 2>/dev/null || echo 'no wheel'))"
fi
if [ -f "$WORK/horovod.whl.path" ] && ! $PY -c 'import horovod.torch' 2>/dev/null; then
  # beside this Python if its environment is writable, else in $SITE (first on PATH and PYTHONPATH)
  if $PY -m pip install -q --no-index --no-deps --no-compile "$(cat "$WORK/horovod.whl.path")" >>"$HVD_LOG" 2>&1; then
    log "Horovod installed beside $PY"
  else
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$(cat "$WORK/horovod.whl.path")" >>"$HVD_LOG" 2>&1
    log "Horovod installed in $SITE: exit $?"
  fi
fi

if has horovod && [ ! -f "$WORK/horovod.done" ] && [ -f "$WORK/horovod.whl.path" ]; then
  log "make gpu-check-horovod"
  OUT="$WORK/out/horovod" GPU_CHECK_REUSE_BUILD=1 timeout $(($(left) - 30)) bash scripts/gpu_check_horovod.sh \
    >"$WORK/out/horovod.log" 2>&1
  log "gpu-check-horovod exit $?"; touch "$WORK/horovod.done"; pack
fi

if has overhead && [ ! -f "$WORK/overhead.done" ] && [ -f "$WORK/horovod.whl.path" ]; then
  mkdir -p "$WORK/out/overhead"
  for dev in cuda cpu; do
    log "overhead --calls --device $dev"
    timeout $((${OVERHEAD_S:-120} / 2)) $PY -m benchmarks overhead --calls --device $dev --tensors 16,64 \
      --steps 60 --modes none,qsgd4-auto,qsgd4-buffered >"$WORK/out/overhead/calls_$dev.md" 2>&1
    log "overhead ($dev) exit $?"
  done
  touch "$WORK/overhead.done"; pack
fi

if has train && [ -f "$WORK/horovod.whl.path" ]; then
  mkdir -p "$WORK/out/train" "$WORK/lm"
  seeds=${LM_SEEDS:-1}
  rate=()
  why=$($PY -c 'from benchmarks import netns; print(netns.probe() or "")' 2>&1 | tail -1)
  if [ -z "$why" ]; then rate=(--rate "${LM_RATE:-1gbit}"); log "links shaped to ${LM_RATE:-1gbit}"
  else log "no network namespaces here ($why): loopback"; fi
  budget=$(($(left) - 15))
  log "training: seeds $seeds, methods ${LM_METHODS:-none,fp16,qsgd8,qsgd4}, $budget s"
  timeout "$budget" $PY -m benchmarks convergence --workload lm --device cuda --np "${LM_NP:-4}" \
    --methods "${LM_METHODS:-none,fp16,qsgd8,qsgd4}" --seeds "$seeds" --steps "${LM_STEPS:-300}" "${rate[@]}" \
    --out "$WORK/lm/s$seeds" --json "$WORK/out/train/lm_s$seeds.json" --png "$WORK/out/train/lm_s$seeds.png" \
    >"$WORK/out/train/lm_s$seeds.log" 2>&1
  log "training exit $?"
  sed -n '/^| method/,$p' "$WORK/out/train/lm_s$seeds.log" >"$WORK/out/train/lm_table.md"
  pack
fi
pack
log "done, $(left) s to the deadline"
