#!/usr/bin/env bash
# Build Horovod from the package registry's source distribution against the frameworks installed in
# the given Python, with PyTorch, TensorFlow, Gloo and MPI; cache the wheel outside the repository,
# keyed by the versions involved. Prints the wheel's path on stdout (everything else goes to stderr).
#
# Usage: scripts/build_horovod.sh /path/to/python
#
# HVD_QSGD_HOROVOD_FRAMEWORKS=torch: PyTorch and Gloo only (no TensorFlow, no MPI; for a machine that
# has no TensorFlow, as the GPU machine of `make gpu-check-horovod`). HVD_QSGD_HOROVOD_SDIST=PATH: build
# from that source distribution instead of downloading it (for a machine without network).
#
# Horovod 0.28.1 does not build as-is against torch 2.13 and TensorFlow 2.21; the four fixes below
# are applied to the unpacked source, and each one fails loudly if the line it changes is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/versions.sh"
VPY="${1:?usage: build_horovod.sh PYTHON}"
log() { printf '[horovod] %s\n' "$*" >&2; }
die() { printf '[horovod] error: %s\n' "$*" >&2; exit 1; }

FRAMEWORKS="${HVD_QSGD_HOROVOD_FRAMEWORKS:-torch,tensorflow}"
case "$FRAMEWORKS" in
    torch,tensorflow) WITH_TF=1 ;;
    torch) WITH_TF=0 ;;
    *) die "HVD_QSGD_HOROVOD_FRAMEWORKS must be 'torch,tensorflow' (default) or 'torch', got '$FRAMEWORKS'" ;;
esac
read -r PYV TORCHV TFV TFINC < <(WITH_TF=$WITH_TF "$VPY" - <<'PY'
import os, sys, torch
if os.environ["WITH_TF"] == "1":
    import tensorflow as tf
    tf_version, tf_include = tf.__version__, tf.sysconfig.get_include()
else:
    tf_version, tf_include = "none", "-"
print(f"cp{sys.version_info.major}{sys.version_info.minor}", torch.__version__.split("+")[0],
      tf_version, tf_include)
PY
)
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCHV}_tf-${TFV}_${PYV}"
CACHE="${HVD_QSGD_CACHE:-$HOME/.cache/hvd_qsgd}/wheels/$KEY"
mkdir -p "$CACHE"
WHEEL="$(ls "$CACHE"/horovod-${HOROVOD_VERSION}-*.whl 2>/dev/null | head -1 || true)"
if [ -n "$WHEEL" ]; then
    log "cached wheel: $WHEEL"
    echo "$WHEEL"; exit 0
fi

WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
if [ -n "${HVD_QSGD_HOROVOD_SDIST:-}" ]; then
    [ -f "$HVD_QSGD_HOROVOD_SDIST" ] || die "HVD_QSGD_HOROVOD_SDIST=$HVD_QSGD_HOROVOD_SDIST is not a file"
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

# The system cmake, not one from the registry (fix 1).
command -v cmake >/dev/null || die "cmake not found (the system cmake 3.x is needed)"
export PATH="/usr/bin:$PATH"
log "building $KEY (3 to 15 minutes on 2 cores)"
if [ "$WITH_TF" = 1 ]; then
    FLAGS=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1)
else
    FLAGS=(HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MPI=1)
fi
env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 "${FLAGS[@]}" MAKEFLAGS="-j$(nproc)" \
    "$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" "$SRC" >&2 \
    || die "the Horovod build failed (see above)"
WHEEL_BUILT="$(ls "$WORK"/dist/horovod-*.whl | head -1)"
cp "$WHEEL_BUILT" "$CACHE/.tmp.whl" && mv "$CACHE/.tmp.whl" "$CACHE/$(basename "$WHEEL_BUILT")"
log "cached $CACHE/$(basename "$WHEEL_BUILT")"
echo "$CACHE/$(basename "$WHEEL_BUILT")"
