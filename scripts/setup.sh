#!/usr/bin/env bash
# One-command environment: Open MPI, a .venv at the repository root with the pinned stack,
# Horovod built from its source distribution (cached wheel), and this project (editable).
#
# Re-running is cheap: every step checks a stamp or what is installed before doing work.
#
# Usage: scripts/setup.sh [--plan]
#   --plan  print what set-up would do on this machine and stop (setup.<name>=<value> lines, then
#           scripts/build_horovod.sh's horovod.<name>=<value> lines where torch is installed): nothing
#           is downloaded, installed or built; pip is asked with --dry-run (index pages and metadata).
#
# torch, decided from the machine before anything is downloaded (scripts/machine.sh, hq_torch_plan):
#   - whichever build pip takes for torch==$PY_TORCH_VERSION, when it is a CPU build (this kind of
#     machine keeps a local CPU wheel that pip prefers; elsewhere the registry's default may be one);
#   - a CUDA build (the registry's default on Linux x86_64) where there is a CUDA toolkit ($CUDA_HOME,
#     nvcc's resolved path, /usr/local/cuda): Horovod is then built with CUDA, and with NCCL where
#     torch's nvidia-nccl package ships its headers (scripts/build_horovod.sh);
#   - a CUDA build and no toolkit: the CPU build from PyTorch's CPU index where it is reachable, else
#     stop at once with one line that names both ways out.
# Environment:
#   TORCH_VERSION, TF_VERSION, TF_KERAS_VERSION  other versions than the pins (scripts/versions.sh)
#   TORCH_INDEX_URL  install torch from that index (https://download.pytorch.org/whl/cpu: the CPU build)
#   CUDA_HOME        the CUDA toolkit to build Horovod with, for a CUDA build of torch
#   HVD_QSGD_VENV    the virtual environment (default .venv at the repository root)
#   HVD_QSGD_CACHE   where the built Horovod wheel is kept (default ~/.cache/hvd_qsgd)
#   PYTHON           the Python that creates the virtual environment (default python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. scripts/versions.sh
. scripts/machine.sh
PLAN=0
case "${1:-}" in
    --plan) PLAN=1 ;;
    "") ;;
    *) printf '[setup] error: usage: scripts/setup.sh [--plan]\n' >&2; exit 2 ;;
esac

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
plan() { printf 'setup.%s=%s\n' "$1" "$2"; }

# 1. Open MPI from Debian.
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicxx >/dev/null 2>&1; then
    if [ "$PLAN" = 1 ]; then
        if command -v apt-get >/dev/null; then plan openmpi "install (apt-get install openmpi-bin libopenmpi-dev)"
        else plan openmpi "missing, and no apt-get: install Open MPI (mpirun, mpi.h) by hand"; fi
    else
        log "installing Open MPI (openmpi-bin libopenmpi-dev)"
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        command -v apt-get >/dev/null || die "apt-get not found: install Open MPI (mpirun, mpi.h) by hand"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
        command -v mpicxx >/dev/null || die "mpirun/mpicxx still missing after installing Open MPI"
    fi
elif [ "$PLAN" = 1 ]; then
    plan openmpi "present ($(command -v mpicxx))"
fi

# 2. The virtual environment.
PY="${PYTHON:-python3}"
VENV="${HVD_QSGD_VENV:-$ROOT/.venv}"
VPY="$VENV/bin/python"
if [ ! -x "$VPY" ]; then
    if [ "$PLAN" = 1 ]; then
        plan venv "create $VENV with $("$PY" --version 2>&1)"
    else
        log "creating $VENV with $($PY --version)"
        "$PY" -m venv "$VENV"
    fi
elif [ "$PLAN" = 1 ]; then
    plan venv "$VENV (exists)"
fi
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

# 3. Python packages (pinned frameworks; torch as decided above).
REQS=(
  "torch==${PY_TORCH_VERSION}"
  "tensorflow-cpu==${PY_TF_VERSION}"
  "tf_keras==${PY_TF_KERAS_VERSION}"
  mpi4py numpy pytest hypothesis scikit-learn matplotlib tqdm
  cffi cloudpickle psutil pyyaml packaging setuptools wheel
)
REQ_KEY="$( (printf '%s\n' "${REQS[@]}"; [ -z "${TORCH_INDEX_URL:-}" ] || echo "index=$TORCH_INDEX_URL") \
            | sha1sum | cut -c1-12)"
STAMP="$VENV/.hvd_qsgd_reqs_${REQ_KEY}"
STALE="$VENV/.hvd_qsgd_horovod_stale"   # the frameworks changed since Horovod was installed
PACKAGES_CURRENT=1
[ -e "$STAMP" ] || PACKAGES_CURRENT=0
if [ "$PACKAGES_CURRENT" = 1 ]; then
    [ "$PLAN" = 0 ] || plan packages "up to date ($STAMP)"
else
    # which torch pip would take, and what to do about it, asked before anything is downloaded
    PIPPY="$VPY"; [ -x "$PIPPY" ] || PIPPY="$PY"
    hq_torch_plan "$PIPPY" "torch==${PY_TORCH_VERSION}"
    if [ "$PLAN" = 1 ]; then
        plan packages "install ${REQS[*]}"
        plan torch_spec "torch==${PY_TORCH_VERSION}"
        if [ -n "$PICK_VERSION" ]; then
            plan torch "$PICK_VERSION"
            plan torch_source "$PICK_SOURCE $PICK_URL"
            plan torch_build "$PICK_BUILD"
            plan torch_nccl "$PICK_NCCL_DEP"
        fi
        if [ "$TORCH_ACTION" = installed ]; then
            plan cuda_home "looked for by build_horovod.sh, from the installed torch"
        elif [ "$PICK_BUILD" = cpu ]; then
            plan cuda_home "not needed (a CPU build of torch)"
        else
            plan cuda_home "${CUDA_FOUND_HOME:-none}${CUDA_FOUND_HOW:+ ($CUDA_FOUND_HOW)}"
        fi
        plan torch_action "$TORCH_ACTION${TORCH_INDEX:+ from $TORCH_INDEX}"
        if [ "$TORCH_ACTION" = stop ]; then
            plan stop "$TORCH_STOP"
            exit 0
        fi
        plan torch_why "$TORCH_WHY"
        case "$TORCH_ACTION/$PICK_BUILD" in
            installed/*) plan horovod "build against the installed torch, after the other packages" ;;
            cpu-index/*|*/cpu) plan horovod "build after the packages: CPU only (torch is a CPU build)" ;;
            */cuda) plan horovod "build after the packages: CUDA (toolkit $CUDA_FOUND_HOME), NCCL $(
                [ "$PICK_NCCL_DEP" = none ] && echo "only where HOROVOD_NCCL_HOME is set" \
                || echo "from $PICK_NCCL_DEP where it ships include/nccl.h and lib/libnccl.so.2")" ;;
        esac
        plan tensorflow "tensorflow-cpu==${PY_TF_VERSION} tf_keras==${PY_TF_KERAS_VERSION}"
        exit 0
    fi
    [ "$TORCH_ACTION" != stop ] || die "$TORCH_STOP"
    log "installing Python packages (torch==${PY_TORCH_VERSION}, tensorflow-cpu==${PY_TF_VERSION}, ...)"
    log "torch: $TORCH_WHY"
    # torch first and alone, as decided: nothing later may replace it with another build.
    if [ -n "$TORCH_INDEX" ]; then
        "${PIP[@]}" --index-url "$TORCH_INDEX" "torch==${PY_TORCH_VERSION}"
    else
        "${PIP[@]}" "torch==${PY_TORCH_VERSION}"
    fi
    "${PIP[@]}" "${REQS[@]}"
    "$VPY" - <<PYCHK
import torch, tensorflow as tf
assert torch.__version__.split("+")[0] == "${PY_TORCH_VERSION}", torch.__version__
assert tf.__version__ == "${PY_TF_VERSION}", tf.__version__
print("[setup] installed torch", torch.__version__,
      f"(CUDA {torch.version.cuda} build)" if torch.version.cuda else "(CPU build)", "and tensorflow", tf.__version__)
PYCHK
    rm -f "$VENV"/.hvd_qsgd_reqs_*
    touch "$STALE" "$STAMP"
fi

# 4. Horovod, from a cached wheel built from the registry's source distribution against the installed
#    frameworks (scripts/build_horovod.sh: CUDA and NCCL with a CUDA build of torch).
HOROVOD_NEW=0
if [ "$PLAN" = 1 ]; then
    if [ -e "$STALE" ] || ! "$VPY" -c "import horovod, sys; sys.exit(horovod.__version__ != '${HOROVOD_VERSION}')" 2>/dev/null; then
        plan horovod "build or take from the cache, and install"
    else
        plan horovod "installed (${HOROVOD_VERSION}); for these frameworks it would be:"
    fi
    bash scripts/build_horovod.sh --plan "$VPY"
    exit 0
fi
if [ -e "$STALE" ] || ! "$VPY" -c "import horovod, sys; sys.exit(horovod.__version__ != '${HOROVOD_VERSION}')" 2>/dev/null; then
    WHEEL="$(bash scripts/build_horovod.sh "$VPY")"
    log "installing $(basename "$WHEEL")"
    "${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
    rm -f "$STALE"
    HOROVOD_NEW=1
fi

# 5. This project, editable (builds the native codec library from kernels/).
if ! "$VPY" -c "import hvd_qsgd._native as n; n.load()" 2>/dev/null || [ -n "$(find kernels setup.py hvd_qsgd/tensorflow/qsgd_ops.cc -newer "$VENV/.hvd_qsgd_built" 2>/dev/null | head -1)" ] || [ ! -e "$VENV/.hvd_qsgd_built" ]; then
    log "building and installing hvd_qsgd (editable)"
    "${PIP[@]}" --no-build-isolation --no-deps -e .
    touch "$VENV/.hvd_qsgd_built"
fi
READY="$("$VPY" -c 'import horovod, torch, tensorflow as tf, hvd_qsgd; print(f"horovod {horovod.__version__}, torch {torch.__version__}, tensorflow {tf.__version__}, hvd_qsgd {hvd_qsgd.__version__}"); print("cuda" if torch.version.cuda else "cpu")' 2>/dev/null || true)"
log "ready: $(printf '%s\n' "$READY" | head -1)"
# What Horovod was built with, when it was installed now against a CUDA build of torch (GPU machines;
# with a CPU build, build_horovod.sh's "built:" line above says it).
if [ "$HOROVOD_NEW" = 1 ] && [ "$(printf '%s\n' "$READY" | tail -1)" = cuda ]; then
    "$VENV/bin/horovodrun" --check-build || true
fi
