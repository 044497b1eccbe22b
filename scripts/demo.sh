#!/usr/bin/env bash
# The demo (`make demo`): data-parallel training of a small MLP on scikit-learn's digits with the
# stock hvd.DistributedOptimizer, four times -- compression=hvd.Compression.none (float32
# allreduce), hvd.Compression.fp16, and hvd_qsgd.QSGD(8) and QSGD(4) (the library's defaults) --
# each under horovodrun on this machine's loopback, and right after it the same training over links
# shaped to 1 Gbit/s between network namespaces (benchmarks/demo_shaped.py; where namespaces cannot
# be made, the table shows the cost model's projection instead, labelled as one); then one table:
# test accuracy, bytes one rank sends per step, ratio to float32, training time per step on
# loopback and on the shaped links (benchmarks/demo_report.py).
#
# Usage: bash scripts/demo.sh [NP]        (NP ranks on this machine, default 4)
# Environment:
#   DEMO_EPOCHS         epochs per loopback run (default 10)
#   DEMO_CONTROLLER     gloo (default) or mpi, for the loopback runs
#   DEMO_SHAPED         auto (default): shaped runs where network namespaces can be made (root,
#                       ip, tc), else the projection; measure: shaped runs or fail; projection:
#                       the projection only
#   DEMO_RATE           the shaped links' rate, a tc rate (default 1gbit)
#   DEMO_SHAPED_HIDDEN  the MLP's hidden width in the shaped runs (default 4096: 16.8M float32
#                       gradient elements a step, so that the exchange is a real share of the step;
#                       the loopback runs keep the example's 512, whose step is bound by per-operation
#                       overheads rather than bytes on this machine)
#   DEMO_SHAPED_STEPS   steps per shaped run (default 6; with 10 loopback epochs the whole demo
#                       takes about 5 minutes on 2 shared cores, most of it the start-up of 8 jobs
#                       of 4 ranks; the table compares time per step). DEMO_SHAPED_HIDDEN=512
#                       DEMO_SHAPED_STEPS=110 repeats the loopback runs exactly.
#   DEMO_RUNS           which runs, of none fp16 qsgd8 qsgd4 (default: all four)
# The namespaces are deleted on every way out (the trap below, and the shaped runs' own handlers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

NP="${1:-4}"
EPOCHS="${DEMO_EPOCHS:-10}"
CONTROLLER="${DEMO_CONTROLLER:-gloo}"
SHAPED="${DEMO_SHAPED:-auto}"
RATE="${DEMO_RATE:-1gbit}"
SHAPED_HIDDEN="${DEMO_SHAPED_HIDDEN:-4096}"
SHAPED_STEPS="${DEMO_SHAPED_STEPS:-6}"
read -r -a RUNS <<<"$(echo "${DEMO_RUNS:-none fp16 qsgd8 qsgd4}" | tr ',' ' ')"

die() { printf '[demo] error: %s\n' "$*" >&2; exit 1; }
[[ "$NP" =~ ^[1-9][0-9]*$ ]] || die "NP must be a positive integer, got '$NP'"
[[ "$EPOCHS" =~ ^[1-9][0-9]*$ ]] || die "DEMO_EPOCHS must be a positive integer, got '$EPOCHS'"
[[ "$SHAPED_STEPS" =~ ^[1-9][0-9]*$ ]] || die "DEMO_SHAPED_STEPS must be a positive integer, got '$SHAPED_STEPS'"
[[ "$SHAPED_HIDDEN" =~ ^[1-9][0-9]*$ ]] || die "DEMO_SHAPED_HIDDEN must be a positive integer, got '$SHAPED_HIDDEN'"
[[ "$CONTROLLER" == gloo || "$CONTROLLER" == mpi ]] || die "DEMO_CONTROLLER must be gloo or mpi"
[[ "$SHAPED" == auto || "$SHAPED" == measure || "$SHAPED" == projection ]] ||
    die "DEMO_SHAPED must be auto, measure or projection, got '$SHAPED'"
[ "${#RUNS[@]}" -gt 0 ] || die "DEMO_RUNS names no run"
for r in "${RUNS[@]}"; do
    [[ "$r" == none || "$r" == fp16 || "$r" == qsgd8 || "$r" == qsgd4 ]] ||
        die "DEMO_RUNS: unknown run '$r' (none fp16 qsgd8 qsgd4)"
done

# Open MPI refuses to run as root without these; TensorFlow's start-up chatter is silenced.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export TF_CPP_MIN_LOG_LEVEL=2
export PYTHONUNBUFFERED=1

# The ranks must run the virtualenv's interpreter: a bare `python` on PATH may not have torch.
PY="$ROOT/.venv/bin/python"
HVDRUN="$ROOT/.venv/bin/horovodrun"
[ -x "$PY" ] && [ -x "$HVDRUN" ] || die "no .venv with horovodrun: run 'make setup' first"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/hvd_qsgd_demo.XXXXXX")"
SHAPED_PID=""
# On any way out: stop the shaped runs (SIGTERM: they kill their ranks and delete their
# namespaces), then delete namespaces of this scheme whose creator is gone (one killed outright).
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [ -n "$SHAPED_PID" ]; then
        if kill -0 "$SHAPED_PID" 2>/dev/null; then
            kill -TERM "$SHAPED_PID" 2>/dev/null || true
            wait "$SHAPED_PID" 2>/dev/null || true
        fi
        "$PY" -m benchmarks.demo_shaped --remove-stale || true
    fi
    rm -rf "$TMP"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# One loopback run. Rank output (stdout, with rank 0's progress bar) goes to the terminal;
# horovodrun's stderr goes to a log that is shown only if the run fails: it is mostly the
# start-up noise of the framework probes horovodrun runs before launching.
flags() {
    case "$1" in
        none) echo --compression none ;;
        fp16) echo --compression fp16 ;;
        qsgd8) echo --compression qsgd --bits 8 ;;
        qsgd4) echo --compression qsgd --bits 4 ;;
    esac
}
run() {
    local tag="$1"
    local log="$TMP/loopback/$tag.log"
    printf '\n[demo] === %s: horovodrun -np %s --%s, loopback (%s epochs) ===\n' "$tag" "$NP" "$CONTROLLER" "$EPOCHS"
    # shellcheck disable=SC2046
    if ! "$HVDRUN" -np "$NP" "--$CONTROLLER" -H "localhost:$NP" \
            "$PY" examples/pytorch_digits.py --epochs "$EPOCHS" --json "$TMP/loopback/$tag.json" $(flags "$tag") \
            2>"$log"; then
        printf '[demo] error: the %s run failed; the end of its stderr:\n' "$tag" >&2
        grep -v -E '^(WARNING: All log messages before absl::InitializeLog|I0000 .*(port|cudart_stub)\.cc)' \
            "$log" | tail -n 40 >&2 || true
        exit 1
    fi
    [ -s "$TMP/loopback/$tag.json" ] || die "the $tag run wrote no results ($TMP/loopback/$tag.json)"
}

# One run over the shaped links (benchmarks/demo_shaped.py), in the background so that a signal
# reaches the trap at once (bash defers traps while a foreground command runs); it shows its ranks'
# output only if one fails.
shaped() {
    local tag="$1" status=0
    printf '\n[demo] === %s: %s ranks in network namespaces, links shaped to %s (hidden %s, %s steps) ===\n' \
        "$tag" "$NP" "$RATE" "$SHAPED_HIDDEN" "$SHAPED_STEPS"
    "$PY" -m benchmarks.demo_shaped --mode measure --np "$NP" --rate "$RATE" --out "$TMP/shaped" --runs "$tag" \
        --epochs "$SHAPED_STEPS" --max-steps "$SHAPED_STEPS" --hidden "$SHAPED_HIDDEN" &
    SHAPED_PID=$!
    wait "$SHAPED_PID" || status=$?
    [ "$status" -eq 0 ] || die "the $tag run over shaped links failed (exit status $status)"
}

START=$(date +%s)
mkdir -p "$TMP/loopback" "$TMP/shaped"
# measure, or (no namespaces here, or DEMO_SHAPED=projection) projection: then shaped.json says why
MODE="$(DEMO_SHAPED="$SHAPED" "$PY" -m benchmarks.demo_shaped --probe --np "$NP" --rate "$RATE" \
    --out "$TMP/shaped" --hidden "$SHAPED_HIDDEN")"
# Each shaped run right after its loopback run, so that both see the machine's load alike.
for r in "${RUNS[@]}"; do
    run "$r"
    if [ "$MODE" = measure ]; then
        shaped "$r"
    fi
done

echo
"$PY" -m benchmarks.demo_report --np "$NP" --loopback "$TMP/loopback" --shaped "$TMP/shaped" \
    --runs "$(IFS=,; echo "${RUNS[*]}")"
printf '[demo] total %ss\n' "$(( $(date +%s) - START ))"
