#!/usr/bin/env bash
# The demo (`make demo`): data-parallel training of a small MLP on scikit-learn's digits under
# horovodrun with the stock hvd.DistributedOptimizer, four times -- compression=hvd.Compression.none
# (float32 allreduce), hvd.Compression.fp16, and hvd_qsgd.QSGD(8) and QSGD(4) -- then one table:
# test accuracy, bytes one rank sends per step, ratio to float32, time.
#
# Usage: bash scripts/demo.sh [NP]        (NP ranks on this machine, default 4)
# Environment:
#   DEMO_EPOCHS      epochs per run (default 20)
#   DEMO_CONTROLLER  gloo (default) or mpi
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

NP="${1:-4}"
EPOCHS="${DEMO_EPOCHS:-20}"
CONTROLLER="${DEMO_CONTROLLER:-gloo}"

die() { printf '[demo] error: %s\n' "$*" >&2; exit 1; }
[[ "$NP" =~ ^[1-9][0-9]*$ ]] || die "NP must be a positive integer, got '$NP'"
[[ "$EPOCHS" =~ ^[1-9][0-9]*$ ]] || die "DEMO_EPOCHS must be a positive integer, got '$EPOCHS'"
[[ "$CONTROLLER" == gloo || "$CONTROLLER" == mpi ]] || die "DEMO_CONTROLLER must be gloo or mpi"

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
trap 'rm -rf "$TMP"' EXIT

# One training run. Rank output (stdout, with rank 0's progress bar) goes to the terminal;
# horovodrun's stderr goes to a log that is shown only if the run fails: it is mostly the
# start-up noise of the framework probes horovodrun runs before launching.
run() {
    local tag="$1"; shift
    local log="$TMP/$tag.log" t0 t1
    printf '\n[demo] === %s: horovodrun -np %s --%s (%s epochs) ===\n' "$tag" "$NP" "$CONTROLLER" "$EPOCHS"
    t0=$(date +%s.%N)
    if ! "$HVDRUN" -np "$NP" "--$CONTROLLER" -H "localhost:$NP" \
            "$PY" examples/pytorch_digits.py --epochs "$EPOCHS" --json "$TMP/$tag.json" "$@" \
            2>"$log"; then
        printf '[demo] error: the %s run failed; the end of its stderr:\n' "$tag" >&2
        grep -v -E '^(WARNING: All log messages before absl::InitializeLog|I0000 .*(port|cudart_stub)\.cc)' \
            "$log" | tail -n 40 >&2 || true
        exit 1
    fi
    t1=$(date +%s.%N)
    [ -s "$TMP/$tag.json" ] || die "the $tag run wrote no results ($TMP/$tag.json)"
    echo "$t0 $t1" | awk '{printf "%.2f\n", $2 - $1}' >"$TMP/$tag.wall"
}

START=$(date +%s)
run none --compression none
run fp16 --compression fp16
run qsgd8 --compression qsgd --bits 8
run qsgd4 --compression qsgd --bits 4

"$PY" - "$TMP" "$NP" <<'EOF'
import json, sys
tmp, np_ = sys.argv[1], sys.argv[2]
rows = []
for tag in ("none", "fp16", "qsgd8", "qsgd4"):
    with open(f"{tmp}/{tag}.json") as f:
        r = json.load(f)
    with open(f"{tmp}/{tag}.wall") as f:
        wall = float(f.read())
    label = f"QSGD({r['bits']}), bucket {r['bucket_size']}" if r["compression"] == "qsgd" else tag
    rows.append((label, r, wall))
base = rows[0][1]["bytes_per_step"]
head = ("compression", "test accuracy", "bytes sent per step", "ratio vs none", "time (s)", "run (s)")
body = [(label, f"{r['test_accuracy']:.4f}", f"{r['bytes_per_step']:,}",
         f"{r['bytes_per_step'] / base:.3f} ({base / r['bytes_per_step']:.1f}x less)" if label != "none"
         else "1.000", f"{r['train_time_s']:.2f}", f"{wall:.1f}") for label, r, wall in rows]
w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
line = lambda cells: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
print()
print(f"[demo] digits MLP, {np_} ranks, {rows[0][1]['epochs']} epochs, {rows[0][1]['steps']} steps; "
      "bytes sent per step by one rank; time = training loop, run = whole horovodrun")
print(line(head))
print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for b in body:
    print(line(b))
q = rows[-1][1]
raw = q["stats"]["raw_elements"] // q["steps"]
print(f"[demo] QSGD quantizes {', '.join(q['quantized'])} (tensors of >= {q['min_numel']:,} elements); "
      f"the other {raw:,} gradient elements go as float32, and each quantized tensor adds a control "
      f"vector to Horovod's allreduce ({q['control_bytes_per_step']} bytes per step, not counted above)")
bad = [label for label, r, _ in rows if not r["params_identical"]]
if bad:
    sys.exit(f"[demo] error: parameters differ across ranks in: {', '.join(bad)}")
print(f"[demo] all runs ended with bit-identical parameters on all {np_} ranks")
if rows[0][1]["test_accuracy"] <= 0.95:
    print(f"[demo] warning: uncompressed accuracy {rows[0][1]['test_accuracy']:.4f} <= 0.95 "
          "(raise DEMO_EPOCHS)")
EOF
printf '[demo] total %ss\n' "$(( $(date +%s) - START ))"
