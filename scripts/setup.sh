#!/usr/bin/env bash
# One-command environment: Open MPI, a .venv at the repository root with the pinned stack,
# Horovod built from its source distribution (cached wheel), and this project (editable).
#
# Re-running is cheap: every step checks a stamp or what is installed before doing work.
# Environment:
#   HVD_QSGD_CACHE   where the built Horovod wheel is kept (default ~/.cache/hvd_qsgd)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. scripts/versions.sh

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# 1. Open MPI from Debian.
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicxx >/dev/null 2>&1; then
    log "installing Open MPI (openmpi-bin libopenmpi-dev)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    command -v apt-get >/dev/null || die "apt-get not found: install Open MPI (mpirun, mpi.h) by hand"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
command -v mpicxx >/dev/null || die "mpirun/mpicxx still missing after installing Open MPI"

# 2. The virtual environment.
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

# 3. Python packages (pinned frameworks; torch is the local CPU build).
REQS=(
  "torch==${PY_TORCH_VERSION}"
  "tensorflow-cpu==${PY_TF_VERSION}"
  "tf_keras==${PY_TF_KERAS_VERSION}"
  mpi4py numpy pytest hypothesis scikit-learn matplotlib tqdm
  cffi cloudpickle psutil pyyaml packaging setuptools wheel
)
REQ_KEY="$(printf '%s\n' "${REQS[@]}" | sha1sum | cut -c1-12)"
STAMP=".venv/.hvd_qsgd_reqs_${REQ_KEY}"
if [ ! -e "$STAMP" ]; then
    log "installing Python packages (torch ${PY_TORCH_VERSION} CPU, tensorflow-cpu ${PY_TF_VERSION}, ...)"
    # torch first and alone: nothing later may replace it with a CUDA build.
    "${PIP[@]}" "torch==${PY_TORCH_VERSION}"
    "${PIP[@]}" "${REQS[@]}"
    "$VPY" - <<PYCHK
import torch, tensorflow as tf
assert torch.__version__.startswith("${PY_TORCH_VERSION}"), torch.__version__
assert not torch.version.cuda, "a CUDA build of torch was installed; expected the local CPU build"
assert tf.__version__ == "${PY_TF_VERSION}", tf.__version__
PYCHK
    rm -f .venv/.hvd_qsgd_reqs_*
    touch "$STAMP"
fi

# 4. Horovod, from a cached wheel built from the registry's source distribution.
if ! "$VPY" -c "import horovod, sys; sys.exit(horovod.__version__ != '${HOROVOD_VERSION}')" 2>/dev/null; then
    WHEEL="$(bash scripts/build_horovod.sh "$VPY")"
    log "installing $(basename "$WHEEL")"
    "${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
fi

# 5. This project, editable (builds the native codec library from kernels/).
if ! "$VPY" -c "import hvd_qsgd._native as n; n.load()" 2>/dev/null || [ -n "$(find kernels setup.py hvd_qsgd/tensorflow/qsgd_ops.cc -newer .venv/.hvd_qsgd_built 2>/dev/null | head -1)" ] || [ ! -e .venv/.hvd_qsgd_built ]; then
    log "building and installing hvd_qsgd (editable)"
    "${PIP[@]}" --no-build-isolation --no-deps -e .
    touch .venv/.hvd_qsgd_built
fi
log "ready: $("$VPY" -c 'import horovod, torch, tensorflow as tf, hvd_qsgd; print(f"horovod {horovod.__version__}, torch {torch.__version__}, tensorflow {tf.__version__}, hvd_qsgd {hvd_qsgd.__version__}")' 2>/dev/null)"
