#!/usr/bin/env bash
# Build Horovod from the package registry's source distribution against the frameworks installed in
# the given Python, with PyTorch, TensorFlow, Gloo and MPI; cache the wheel outside the repository,
# keyed by what it was built against. Prints the wheel's path on stdout (everything else goes to stderr),
# and on stderr one line of what the wheel has (cuda_built, nccl_built, gloo_built, mpi_built).
#
# Usage: scripts/build_horovod.sh [--plan] /path/to/python
#   --plan  print the decisions below (horovod.<name>=<value> lines on stdout) and stop: nothing is
#           downloaded, linked or built.
#
# Decided from the machine:
# - CUDA: when the installed torch is a CUDA build (torch.version.cuda), Horovod's PyTorch extension is
#   a CUDA extension and needs a CUDA toolkit: $CUDA_HOME, else the toolkit of the nvcc on PATH (its
#   resolved path; for a wrapper script, the toolkit nvcc itself reports), else /usr/local/cuda
#   (scripts/machine.sh). It is passed on as CUDA_HOME, HOROVOD_CUDA_HOME and CUDAToolkit_ROOT, its
#   bin/ first on PATH. A CUDA torch and no toolkit: stop at once, saying both ways out.
# - NCCL (HOROVOD_GPU_OPERATIONS=NCCL), with a CUDA torch only: $HOROVOD_NCCL_HOME when set, else the
#   NCCL that comes with torch (the nvidia-nccl-cu* package ships include/nccl.h and lib/libnccl.so.2;
#   a folder of links with the lib/libnccl.so that CMake looks for is made in the cache, linked shared).
#   HVD_QSGD_HOROVOD_NCCL=0 builds without NCCL (GPU tensors then go through Horovod's host
#   collectives, what several ranks on one GPU need), =1 makes its absence an error; default auto.
# - The cache key: Horovod, torch (and its CUDA), TensorFlow, MPI when not the default, the toolkit's
#   CUDA and NCCL versions, Python: one wheel per combination, under ${HVD_QSGD_CACHE:-~/.cache/hvd_qsgd}/wheels/.
#
# HVD_QSGD_HOROVOD_FRAMEWORKS=torch: PyTorch and Gloo only (no TensorFlow and, unless
# HVD_QSGD_HOROVOD_MPI=1, no MPI; for a machine that has no TensorFlow, as the GPU machine of `make
# gpu-check-horovod`). HVD_QSGD_HOROVOD_MPI=0|1: without/with MPI (default: with, when TensorFlow is
# built). HVD_QSGD_HOROVOD_SDIST=PATH: build from that source distribution instead of downloading it
# (for a machine without network).
#
# Horovod 0.28.1 does not build as-is against torch 2.13 and TensorFlow 2.21; the four fixes below
# are applied to the unpacked source, and each one fails loudly if the line it changes is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/versions.sh"
. "$ROOT/scripts/machine.sh"
PLAN=0
if [ "${1:-}" = "--plan" ]; then PLAN=1; shift; fi
VPY="${1:?usage: build_horovod.sh [--plan] PYTHON}"
# a bare name is resolved now: the build puts /usr/bin first on PATH, where another python3 may be
case "$VPY" in */*) ;; *) VPY="$(command -v "$VPY")" || { printf '[horovod] error: no %s on PATH\n' "$1" >&2; exit 1; } ;; esac
log() { printf '[horovod] %s\n' "$*" >&2; }
die() { printf '[horovod] error: %s\n' "$*" >&2; exit 1; }
plan() { printf 'horovod.%s=%s\n' "$1" "$2"; }
# stop REASON: the one line that ends a build that cannot go on (in --plan: the plan's last line)
stop() {
    if [ "$PLAN" = 1 ]; then plan action "stop: $1"; exit 0; fi
    die "$1"
}

FRAMEWORKS="${HVD_QSGD_HOROVOD_FRAMEWORKS:-torch,tensorflow}"
case "$FRAMEWORKS" in
    torch,tensorflow) WITH_TF=1 ;;
    torch) WITH_TF=0 ;;
    *) die "HVD_QSGD_HOROVOD_FRAMEWORKS must be 'torch,tensorflow' (default) or 'torch', got '$FRAMEWORKS'" ;;
esac
WITH_MPI="${HVD_QSGD_HOROVOD_MPI:-$WITH_TF}"
case "$WITH_MPI" in 0|1) ;; *) die "HVD_QSGD_HOROVOD_MPI must be 0 or 1, got '$WITH_MPI'" ;; esac
NCCL_MODE="${HVD_QSGD_HOROVOD_NCCL:-auto}"
case "$NCCL_MODE" in auto|0|1) ;; *) die "HVD_QSGD_HOROVOD_NCCL must be auto, 0 or 1, got '$NCCL_MODE'" ;; esac
if [ -n "${HVD_QSGD_HOROVOD_SDIST:-}" ] && [ ! -f "$HVD_QSGD_HOROVOD_SDIST" ]; then
    die "HVD_QSGD_HOROVOD_SDIST=$HVD_QSGD_HOROVOD_SDIST is not a file"
fi

# What the given Python has: torch (and its CUDA), TensorFlow, the NCCL that came with torch.
PROBE="$(WITH_TF=$WITH_TF TF_CPP_MIN_LOG_LEVEL=3 "$VPY" - 2>&1 <<'PY'
import importlib.util, os, re, sys
import torch
if os.environ["WITH_TF"] == "1":
    import tensorflow as tf
    tf_version, tf_include = tf.__version__, tf.sysconfig.get_include()
else:
    tf_version, tf_include = "none", "-"
cuda = torch.version.cuda or "none"
nccl_dir, nccl_version = "-", "none"
if cuda != "none":
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ImportError:
        spec = None
    for d in (spec.submodule_search_locations if spec else None) or []:
        if os.path.isfile(os.path.join(d, "include", "nccl.h")) and os.path.isfile(os.path.join(d, "lib", "libnccl.so.2")):
            nccl_dir = d
            header = open(os.path.join(d, "include", "nccl.h")).read()
            parts = [re.search(rf"^#define NCCL_{k}\s+(\d+)", header, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
            nccl_version = ".".join(p.group(1) for p in parts) if all(parts) else "unknown"
            break
print("PROBE", f"cp{sys.version_info.major}{sys.version_info.minor}", torch.__version__, cuda, tf_version, tf_include,
      nccl_dir, nccl_version)
PY
)" || die "cannot import torch$([ "$WITH_TF" = 1 ] && echo ' and tensorflow') with $VPY: $(printf '%s' "$PROBE" | tail -1)"
read -r PYV TORCH_FULL TORCH_CUDA TFV TFINC TORCH_NCCL_DIR TORCH_NCCL_VER <<<"$(printf '%s\n' "$PROBE" | sed -n 's/^PROBE //p' | tail -1)"
TORCHV="${TORCH_FULL%%+*}"
CACHE_ROOT="${HVD_QSGD_CACHE:-$HOME/.cache/hvd_qsgd}"
BUILD_ENV=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1)
if [ "$WITH_TF" = 1 ]; then BUILD_ENV+=(HOROVOD_WITH_TENSORFLOW=1); else BUILD_ENV+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
if [ "$WITH_MPI" = 1 ]; then BUILD_ENV+=(HOROVOD_WITH_MPI=1); else BUILD_ENV+=(HOROVOD_WITHOUT_MPI=1); fi
KEY_TORCH="torch-${TORCHV}" KEY_MPI="" KEY_GPU=""
[ "$WITH_MPI" = "$WITH_TF" ] || KEY_MPI="_mpi-${WITH_MPI}"
CUDA_USE="" CUDA_VER="none" NCCL_USE="" NCCL_VER="none" NCCL_SRC="" NCCL_WHY=""
[ "$PLAN" = 1 ] && plan python "$PYV $VPY" && plan torch "$TORCH_FULL (CUDA: $TORCH_CUDA)" \
    && plan tensorflow "$TFV" && plan mpi "$WITH_MPI"
if [ "$TORCH_CUDA" != none ]; then
    hq_find_cuda_home
    [ -z "$CUDA_FOUND_ERR" ] || stop "$CUDA_FOUND_ERR"
    if [ -z "$CUDA_FOUND_HOME" ]; then
        stop "torch $TORCH_FULL is a CUDA build (CUDA $TORCH_CUDA), so Horovod's PyTorch extension needs a CUDA toolkit, and none was found ($CUDA_FOUND_HOW): install one and run with CUDA_HOME=/path/to/cuda, or install a CPU build of torch (TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make setup)"
    fi
    CUDA_USE="$CUDA_FOUND_HOME"
    CUDA_VER="$(hq_cuda_version "$CUDA_USE")"
    [ "$PLAN" = 1 ] && plan cuda_home "$CUDA_USE (found from $CUDA_FOUND_HOW; CUDA $CUDA_VER)"
    BUILD_ENV+=("CUDA_HOME=$CUDA_USE" "HOROVOD_CUDA_HOME=$CUDA_USE" "CUDAToolkit_ROOT=$CUDA_USE")
    KEY_TORCH="torch-${TORCHV}-cu${TORCH_CUDA}"
    # NCCL
    if [ "$NCCL_MODE" = 0 ]; then
        NCCL_WHY="HVD_QSGD_HOROVOD_NCCL=0"
    elif [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
        [ -f "$HOROVOD_NCCL_HOME/include/nccl.h" ] || stop "HOROVOD_NCCL_HOME=$HOROVOD_NCCL_HOME has no include/nccl.h"
        NCCL_USE="$HOROVOD_NCCL_HOME" NCCL_SRC="HOROVOD_NCCL_HOME"
        NCCL_VER="$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\)[[:space:]]*\([0-9]*\).*/\2/p' "$HOROVOD_NCCL_HOME/include/nccl.h" | head -3 | paste -sd.)"
        NCCL_VER="${NCCL_VER:-unknown}"
    elif [ "$TORCH_NCCL_DIR" != - ]; then
        NCCL_SRC="$TORCH_NCCL_DIR" NCCL_VER="$TORCH_NCCL_VER"
        NCCL_USE="$CACHE_ROOT/nccl/nccl-${NCCL_VER}-$(printf '%s' "$TORCH_NCCL_DIR" | sha1sum | cut -c1-10)"
    else
        NCCL_WHY="no HOROVOD_NCCL_HOME, and torch's environment has no nvidia.nccl package with include/nccl.h and lib/libnccl.so.2"
    fi
    if [ -z "$NCCL_USE" ] && [ "$NCCL_MODE" = 1 ]; then stop "HVD_QSGD_HOROVOD_NCCL=1 but no NCCL: $NCCL_WHY"; fi
    if [ -n "$NCCL_USE" ]; then
        BUILD_ENV+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_NCCL_HOME=$NCCL_USE" HOROVOD_NCCL_LINK=SHARED)
        [ "$PLAN" = 1 ] && plan nccl "$NCCL_VER from $NCCL_SRC (HOROVOD_NCCL_HOME=$NCCL_USE)"
    else
        [ "$PLAN" = 1 ] && plan nccl "none ($NCCL_WHY)"
    fi
    KEY_GPU="_cuda-${CUDA_VER}_nccl-${NCCL_VER}"
elif [ "$PLAN" = 1 ]; then
    plan cuda_home "none (torch is a CPU build)"
    plan nccl "none (torch is a CPU build)"
fi
KEY="horovod-${HOROVOD_VERSION}_${KEY_TORCH}_tf-${TFV}${KEY_MPI}${KEY_GPU}_${PYV}"
CACHE="$CACHE_ROOT/wheels/$KEY"
WHEEL="$(ls "$CACHE"/horovod-${HOROVOD_VERSION}-*.whl 2>/dev/null | head -1 || true)"
if [ "$PLAN" = 1 ]; then
    plan key "$KEY"
    plan env "${BUILD_ENV[*]}"
    if [ -n "$WHEEL" ]; then plan action "use the cached $WHEEL"
    else plan action "build horovod==${HOROVOD_VERSION} from ${HVD_QSGD_HOROVOD_SDIST:-its source distribution on the registry} into $CACHE"; fi
    exit 0
fi
if [ -n "$WHEEL" ]; then
    log "cached wheel: $WHEEL"
    log "$(cat "$CACHE/built.txt" 2>/dev/null || echo "built: (not recorded for this wheel)")"
    echo "$WHEEL"; exit 0
fi
mkdir -p "$CACHE"

WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
if [ -n "${HVD_QSGD_HOROVOD_SDIST:-}" ]; then
    cp "$HVD_QSGD_HOROVOD_SDIST" "$WORK/horovod-${HOROVOD_VERSION}.tar.gz"
else
    log "downloading the horovod==${HOROVOD_VERSION} source distribution"
    "$VPY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==${HOROVOD_VERSION}" >&2
fi
tar xzf "$WORK"/horovod-${HOROVOD_VERSION}.tar.gz -C "$WORK"
SRC="$WORK/horovod-${HOROVOD_VERSION}"

# replace FILE OLD NEW: exact, literal, one line; fail if OLD is not in FILE.
replace() {
    local f="$SRC/$1" old="$2" new="$3"
    grep -qF -- "$old" "$f" || die "fix not applicable: '$old' not found in $1 (was the source changed?)"
    OLD="$old" NEW="$new" "$VPY" - "$f" <<'PY'
import os, sys
p = sys.argv[1]; s = open(p).read()
open(p, "w").write(s.replace(os.environ["OLD"], os.environ["NEW"]))
PY
}
# Fix 1: the registry's CMake 4 refuses the vendored gloo (cmake_minimum_required < 3.5).
#        Use the system cmake (3.25); with a newer one, allow the old policy level.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# Fix 2: PyTorch 2.13's headers need C++20; horovod/torch forces C++14.
replace horovod/torch/CMakeLists.txt "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 20)"
if [ "$WITH_TF" = 0 ]; then
# Fix 3 without TensorFlow (no compatible17_gloo target): build Horovod's own gloo as C++17, where the
#        static constexpr kDefaultTimeout is inline as in the C++20 PyTorch extension.
replace CMakeLists.txt "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 17)"
else
# Fix 3: then link the C++17 build of gloo (else: multiple definition of
#        gloo::rendezvous::Store::kDefaultTimeout). The target exists because TF is built too.
replace horovod/torch/CMakeLists.txt "list(APPEND PYTORCH_LINKER_LIBS gloo)" "list(APPEND PYTORCH_LINKER_LIBS compatible17_gloo)"
# Fix 4b: xla_mpi_ops.cc includes XLA headers that moved in TF 2.21; it only provides the opt-in
#         HOROVOD_ENABLE_XLA_OPS lowering, which this project does not use.
replace horovod/tensorflow/CMakeLists.txt 'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")' '# xla_mpi_ops.cc dropped: its XLA headers moved in TF 2.21'
# Fix 4a: TF 2.21's headers include highwayhash and farmhash from paths not on Horovod's include list.
export CXXFLAGS="${CXXFLAGS:-} -I$TFINC/external/highwayhash -I$TFINC/external/farmhash_archive/src"
fi

# Fix 5: group_table.h uses std::string without <string>, which GCC 13's headers no longer bring in
#        through <mutex>; other sources likewise lean on <cstdint> arriving transitively.
replace horovod/common/group_table.h "#include <mutex>" $'#include <mutex>\n#include <string>'
export CXXFLAGS="${CXXFLAGS:-} -include cstdint"

# The system cmake, not one from the registry (fix 1).
command -v cmake >/dev/null || die "cmake not found (the system cmake 3.x is needed)"
PATH="/usr/bin:$PATH"
if [ -n "$CUDA_USE" ]; then
    # the toolkit's nvcc first: CMake and torch.utils.cpp_extension look for nvcc on PATH, and a
    # wrapper's directory (/usr/local/bin) is not a toolkit
    PATH="/usr/bin:$CUDA_USE/bin:$PATH"
    log "CUDA toolkit $CUDA_USE (CUDA $CUDA_VER; found from $CUDA_FOUND_HOW)"
fi
export PATH
if [ -n "$NCCL_USE" ] && [ -n "$NCCL_SRC" ] && [ "$NCCL_SRC" != HOROVOD_NCCL_HOME ]; then
    # torch's NCCL package ships include/nccl.h and lib/libnccl.so.2; CMake looks for libnccl.so
    mkdir -p "$NCCL_USE/lib"
    ln -sfn "$NCCL_SRC/include" "$NCCL_USE/include"
    ln -sf "$NCCL_SRC/lib/libnccl.so.2" "$NCCL_USE/lib/libnccl.so.2"
    ln -sf "$NCCL_SRC/lib/libnccl.so.2" "$NCCL_USE/lib/libnccl.so"
fi
[ -z "$NCCL_USE" ] || log "NCCL $NCCL_VER (HOROVOD_GPU_OPERATIONS=NCCL, HOROVOD_NCCL_HOME=$NCCL_USE)"
log "building $KEY (3 to 15 minutes on 2 cores)"
env "${BUILD_ENV[@]}" MAKEFLAGS="-j$(nproc)" \
    "$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" "$SRC" >&2 \
    || die "the Horovod build failed (see above)"
WHEEL_BUILT="$(ls "$WORK"/dist/horovod-*.whl | head -1)"

# What the wheel has, asked of Horovod itself (installed in a scratch folder, imported after torch).
"$VPY" -m pip install -q --no-deps --no-index --no-compile --target "$WORK/probe" "$WHEEL_BUILT" >&2 \
    || die "cannot unpack the built wheel $WHEEL_BUILT"
BUILT="$(PYTHONPATH="$WORK/probe" "$VPY" - 2>&1 <<'PY'
import torch
import horovod.torch as hvd
print(f"cuda_built={hvd.cuda_built()} nccl_built={hvd.nccl_built()} gloo_built={hvd.gloo_built()} "
      f"mpi_built={hvd.mpi_built()}")
PY
)" || die "the built Horovod does not import: $(printf '%s' "$BUILT" | tail -3)"
BUILT="built: $(printf '%s' "$BUILT" | tail -1) (horovod ${HOROVOD_VERSION}, torch ${TORCH_FULL}, tensorflow ${TFV}"
BUILT+="${CUDA_USE:+, CUDA $CUDA_VER at $CUDA_USE}${NCCL_USE:+, NCCL $NCCL_VER})"

cp "$WHEEL_BUILT" "$CACHE/.tmp.whl" && mv "$CACHE/.tmp.whl" "$CACHE/$(basename "$WHEEL_BUILT")"
printf '%s\n' "$BUILT" >"$CACHE/built.txt"
log "$BUILT"
log "cached $CACHE/$(basename "$WHEEL_BUILT")"
echo "$CACHE/$(basename "$WHEEL_BUILT")"
