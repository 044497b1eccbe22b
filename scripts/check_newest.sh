#!/usr/bin/env bash
# make check-newest (opt-in; not part of `make test` or CI): the newest torch from the registry in an
# environment of its own, outside the repository, with Horovod built against it as scripts/setup.sh
# would (the CUDA toolkit and NCCL found by themselves), this project installed there, and its PyTorch
# tests run:
#   tests/test_torch_compressor.py tests/test_backends.py tests/test_codec_format.py
# (or the pytest arguments given: scripts/check_newest.sh tests/test_codec_format.py).
#
# It downloads torch (0.5 to 3 GB with a CUDA build's packages) and builds Horovod (5 to 15 minutes on
# 2 cores; the wheel is cached like set-up's). pip's configured constraints are not applied here
# (PIP_CONSTRAINT=/dev/null): "newest" is the registry's newest, not a machine's cap.
# Environment:
#   HVD_QSGD_NEWEST_DIR  the environment and a copy of the working tree (default ~/.cache/hvd_qsgd/newest;
#                        both are made afresh on every run)
#   TORCH_VERSION        a version instead of the newest
#   PYTHON               the Python that makes the environment (default python3)
# The summary (versions, Horovod's build line, the test counts, the times) is printed last and written
# to $HVD_QSGD_NEWEST_DIR/result.txt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/versions.sh"
. "$ROOT/scripts/machine.sh"
DIR="${HVD_QSGD_NEWEST_DIR:-${HVD_QSGD_CACHE:-$HOME/.cache/hvd_qsgd}/newest}"
PY="${PYTHON:-python3}"
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_torch_compressor.py tests/test_backends.py tests/test_codec_format.py)
log() { printf '[check-newest] %s\n' "$*" >&2; }
die() { printf '[check-newest] error: %s\n' "$*" >&2; exit 1; }
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
T0=$SECONDS
elapsed() { echo "$((SECONDS - $1)) s"; }

case "$DIR" in "$ROOT"|"$ROOT"/*) die "HVD_QSGD_NEWEST_DIR must be outside the repository ($DIR)" ;; esac
mkdir -p "$DIR"
VENV="$DIR/venv" SRC="$DIR/src"
rm -rf "$VENV" "$SRC"
log "environment $VENV ($("$PY" --version 2>&1))"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"

# 1. torch: the newest release (or TORCH_VERSION), decided as set-up decides (scripts/machine.sh).
SPEC="torch${TORCH_VERSION:+==$TORCH_VERSION}"
hq_torch_plan "$VPY" "$SPEC"
[ "$TORCH_ACTION" != stop ] || die "$TORCH_STOP"
log "$TORCH_WHY"
T=$SECONDS
PIP=("$VPY" -m pip install -q)
if [ -n "$TORCH_INDEX" ]; then
    "${PIP[@]}" --index-url "$TORCH_INDEX" "torch==$PICK_VERSION"
else
    "${PIP[@]}" "torch==$PICK_VERSION"
fi
"${PIP[@]}" numpy pytest hypothesis ml_dtypes psutil cffi cloudpickle pyyaml packaging setuptools wheel
T_INSTALL="$(elapsed $T)"
read -r TORCH_FULL TORCH_CUDA < <("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")')
log "installed torch $TORCH_FULL (CUDA: $TORCH_CUDA) in $T_INSTALL"

# 2. Horovod (PyTorch, Gloo and MPI; no TensorFlow) built by the project's script, which finds the CUDA
#    toolkit and NCCL itself.
T=$SECONDS
log "building Horovod (log: $DIR/horovod.log)"
WHEEL="$(HVD_QSGD_HOROVOD_FRAMEWORKS=torch HVD_QSGD_HOROVOD_MPI=1 bash "$ROOT/scripts/build_horovod.sh" "$VPY" \
         2>"$DIR/horovod.log")" || { tail -40 "$DIR/horovod.log" >&2; die "the Horovod build failed"; }
grep '^\[horovod\]' "$DIR/horovod.log" >&2 || true
"${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
T_HOROVOD="$(elapsed $T)"
BUILT="$(grep -h '^\[horovod\] built:' "$DIR/horovod.log" | tail -1 | sed 's/^\[horovod\] //')"

# 3. This project, from a copy of the working tree (the repository's own build stays untouched).
T=$SECONDS
mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) \
    | tar -xf - -C "$SRC"
(cd "$SRC" && "$VPY" -m pip install -q --no-build-isolation --no-deps -e .) >"$DIR/package.log" 2>&1 \
    || { tail -30 "$DIR/package.log" >&2; die "installing hvd_qsgd failed (log: $DIR/package.log)"; }
T_PACKAGE="$(elapsed $T)"

# 4. The PyTorch tests.
T=$SECONDS
log "pytest ${TESTS[*]}"
set +e
(cd "$SRC" && "$VPY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}") 2>&1 | tee "$DIR/pytest.log"
RC=${PIPESTATUS[0]}
set -e
T_TESTS="$(elapsed $T)"
COUNTS="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$DIR/pytest.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
{
    echo "check-newest $(date -u +%Y-%m-%dT%H:%MZ): $([ "$RC" = 0 ] && echo PASSED || echo "FAILED (pytest exit $RC)")"
    echo "python $("$VPY" -c 'import platform; print(platform.python_version())'), torch $TORCH_FULL (CUDA: $TORCH_CUDA; $TORCH_WHY)"
    echo "horovod $HOROVOD_VERSION: ${BUILT:-build line not found}"
    echo "tests: ${TESTS[*]}: ${COUNTS:-no summary}"
    echo "times: torch install $T_INSTALL, horovod $T_HOROVOD, package $T_PACKAGE, tests $T_TESTS, total $(elapsed $T0)"
} | tee "$DIR/result.txt"
exit "$RC"
