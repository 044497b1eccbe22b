# What the set-up needs to know about the machine, in one place; sourced by scripts/setup.sh and
# scripts/build_horovod.sh (and so by their --plan modes, which the tests run against fake tools).
# Every function here only looks: nothing is downloaded, installed or built.

# hq_is_cuda_home DIR: DIR is a CUDA toolkit (its nvcc and the runtime's header).
hq_is_cuda_home() {
    [ -n "$1" ] && [ -x "$1/bin/nvcc" ] && [ -f "$1/include/cuda_runtime.h" ]
}

# hq_find_cuda_home: the CUDA toolkit, in this order:
#   1. $CUDA_HOME when set (an error when it is not a toolkit);
#   2. nvcc on PATH, resolved (readlink -f): its ../ when that is a toolkit; else nvcc is a wrapper
#      (a script that execs the real one, as /usr/local/bin/nvcc can be), and nvcc itself says
#      where its toolkit is (`nvcc --dryrun` prints TOP=<toolkit>/bin/..);
#   3. $HVD_QSGD_CUDA_DEFAULT (default /usr/local/cuda), resolved.
# Sets CUDA_FOUND_HOME (empty when none), CUDA_FOUND_HOW (how it was found, or why none was) and
# CUDA_FOUND_ERR (a user error: CUDA_HOME set to something that is not a toolkit).
hq_find_cuda_home() {
    CUDA_FOUND_HOME="" CUDA_FOUND_HOW="" CUDA_FOUND_ERR=""
    local nvcc real dir top
    if [ -n "${CUDA_HOME:-}" ]; then
        if hq_is_cuda_home "$CUDA_HOME"; then
            CUDA_FOUND_HOME="$CUDA_HOME" CUDA_FOUND_HOW="CUDA_HOME"
        else
            CUDA_FOUND_ERR="CUDA_HOME=$CUDA_HOME is not a CUDA toolkit (no bin/nvcc or include/cuda_runtime.h there)"
        fi
        return 0
    fi
    nvcc="$(command -v nvcc 2>/dev/null || true)"
    if [ -n "$nvcc" ]; then
        real="$(readlink -f "$nvcc")"
        dir="$(dirname "$(dirname "$real")")"
        if hq_is_cuda_home "$dir"; then
            CUDA_FOUND_HOME="$dir" CUDA_FOUND_HOW="nvcc on PATH: $nvcc -> $real"
            return 0
        fi
        top="$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1 || true)"
        if [ -n "$top" ]; then
            dir="$(readlink -f "$top")"
            if hq_is_cuda_home "$dir"; then
                CUDA_FOUND_HOME="$dir" CUDA_FOUND_HOW="nvcc on PATH: $nvcc, a wrapper of $dir/bin/nvcc (its --dryrun TOP)"
                return 0
            fi
        fi
    fi
    dir="${HVD_QSGD_CUDA_DEFAULT-/usr/local/cuda}"
    if [ -n "$dir" ] && hq_is_cuda_home "$dir"; then
        CUDA_FOUND_HOME="$(readlink -f "$dir")" CUDA_FOUND_HOW="$dir"
        return 0
    fi
    if [ -n "$nvcc" ]; then nvcc="no toolkit behind $nvcc"; else nvcc="no nvcc on PATH"; fi
    CUDA_FOUND_HOW="no CUDA_HOME, $nvcc, no toolkit at ${dir:-(no default)}"
}

# hq_cuda_version DIR: the toolkit's version (nvcc --version's "release X.Y"), or "unknown".
hq_cuda_version() {
    local v
    v="$("$1/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' | head -1 || true)"
    echo "${v:-unknown}"
}

# hq_reachable URL: whether URL answers within a few seconds (a file: URL: whether it exists).
hq_reachable() {
    "${HQ_PY:-python3}" - "$1" >/dev/null 2>&1 <<'PY'
import os, sys, urllib.parse, urllib.request
url = sys.argv[1]
if url.startswith("file:"):
    sys.exit(0 if os.path.exists(urllib.parse.urlparse(url).path) else 1)
urllib.request.urlopen(url, timeout=8).close()
PY
}

# hq_torch_pick PY ARGS...: which torch `PY -m pip install ARGS...` would install, asked of pip itself
# (--dry-run: the index pages and the wheel's metadata, no wheel). Sets
#   PICK_STATE    install (pip would install PICK_*) | installed (what is installed satisfies ARGS) |
#                 error (PICK_ERR says why)
#   PICK_VERSION  e.g. 2.13.0+cpu;  PICK_URL  where the wheel is;
#   PICK_SOURCE   local-wheel (a file on this machine: a find-links folder or a local index) | index
#                 (an index given by --index-url) | registry;
#   PICK_BUILD    cuda (the wheel needs NVIDIA's CUDA packages, or its version says +cuNNN) | cpu;
#   PICK_NCCL_DEP the NCCL package the wheel brings (e.g. nvidia-nccl-cu13==2.30.7) or none.
hq_torch_pick() {
    local py="$1"; shift
    local report out
    report="$(mktemp)"
    PICK_STATE=error PICK_VERSION="" PICK_URL="" PICK_SOURCE="" PICK_BUILD="" PICK_NCCL_DEP=none PICK_ERR=""
    if ! out="$("$py" -m pip install --dry-run --no-deps --quiet --disable-pip-version-check \
                --report "$report" "$@" 2>&1)"; then
        PICK_ERR="pip cannot resolve $*: $(printf '%s' "$out" | grep -v '^WARNING' | tail -3 | tr '\n' ' ')"
        rm -f "$report"; return 0
    fi
    local line
    line="$("$py" - "$report" "$*" <<'PY'
import json, sys

report, args = sys.argv[1], sys.argv[2]
try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        Requirement = None


def applies(spec):
    """(name, the requirement) when it applies here, outside any extra; None otherwise."""
    if Requirement is not None:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            return None
        return req.name.lower().replace("_", "-"), str(req).split(";")[0].strip()
    name_part, _, marker = spec.partition(";")
    if "extra" in marker:
        return None
    name = name_part.strip().split("[")[0]
    for c in "<>=!~ (":
        name = name.split(c)[0]
    return name.lower().replace("_", "-"), name_part.strip()


torch = [i for i in json.load(open(report)).get("install", [])
         if i["metadata"]["name"].lower() == "torch"]
if not torch:
    print("installed"); sys.exit()
item = torch[0]
version, url = item["metadata"]["version"], item["download_info"]["url"]
deps = [r for r in map(applies, item["metadata"].get("requires_dist") or []) if r]
cuda = any(n.startswith(("nvidia-", "cuda-toolkit", "cuda-runtime")) for n, _ in deps)
local = version.partition("+")[2]
if local.startswith("cu"):
    cuda = True
elif local == "cpu":
    cuda = False
nccl = next((r.replace(" ", "") for n, r in deps if n.startswith("nvidia-nccl")), "none")
source = "local-wheel" if url.startswith("file:") else ("index" if "--index-url" in args else "registry")
print("install", version, url, source, "cuda" if cuda else "cpu", nccl)
PY
)" || { PICK_ERR="cannot read pip's report"; rm -f "$report"; return 0; }
    rm -f "$report"
    read -r PICK_STATE PICK_VERSION PICK_URL PICK_SOURCE PICK_BUILD PICK_NCCL_DEP <<<"$line"
    PICK_NCCL_DEP="${PICK_NCCL_DEP:-none}"
}

# hq_torch_plan PY SPEC [PIP ARGS...]: what the set-up does about torch (SPEC, e.g. torch==2.13.0) with
# PY's pip:
#   - $TORCH_INDEX_URL set: torch from that index (PyTorch's CPU index, say);
#   - pip would take a CPU build (the local wheel of this kind of machine, or the registry's default
#     where it is a CPU build): install it;
#   - pip would take a CUDA build: with a CUDA toolkit, install it (Horovod is then built with CUDA);
#     without one, take the CPU build from PyTorch's CPU index ($HVD_QSGD_TORCH_CPU_INDEX, default
#     https://download.pytorch.org/whl/cpu) where it is reachable, else stop with one line.
# Sets TORCH_ACTION (install | installed | cpu-index | stop), TORCH_INDEX (the index to install from,
# or empty: pip's own configuration), TORCH_WHY (a sentence) and TORCH_STOP (the line, for stop), and
# leaves PICK_* and CUDA_FOUND_* as hq_torch_pick and hq_find_cuda_home set them.
HQ_CPU_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu
hq_torch_plan() {
    local py="$1" spec="$2" cpu_index="${HVD_QSGD_TORCH_CPU_INDEX:-$HQ_CPU_INDEX_DEFAULT}"
    shift 2
    TORCH_ACTION=stop TORCH_INDEX="${TORCH_INDEX_URL:-}" TORCH_WHY="" TORCH_STOP=""
    CUDA_FOUND_HOME="" CUDA_FOUND_HOW="" CUDA_FOUND_ERR=""
    if [ -n "$TORCH_INDEX" ]; then
        hq_torch_pick "$py" --index-url "$TORCH_INDEX" "$@" "$spec"
    else
        hq_torch_pick "$py" "$@" "$spec"
    fi
    case "$PICK_STATE" in
        error) TORCH_STOP="$PICK_ERR"; return 0 ;;
        installed) TORCH_ACTION=installed TORCH_WHY="the installed torch satisfies $spec"; return 0 ;;
    esac
    if [ "$PICK_BUILD" = cpu ]; then
        TORCH_ACTION=install TORCH_WHY="torch $PICK_VERSION, a CPU build, from $PICK_URL ($PICK_SOURCE)"
        return 0
    fi
    hq_find_cuda_home
    if [ -n "$CUDA_FOUND_ERR" ]; then
        TORCH_STOP="$CUDA_FOUND_ERR"; return 0
    fi
    if [ -n "$CUDA_FOUND_HOME" ]; then
        TORCH_ACTION=install
        TORCH_WHY="torch $PICK_VERSION, a CUDA build, from $PICK_URL ($PICK_SOURCE); CUDA toolkit $CUDA_FOUND_HOME ($CUDA_FOUND_HOW)"
        return 0
    fi
    if [ -z "$TORCH_INDEX" ] && hq_reachable "$cpu_index/torch/"; then
        TORCH_ACTION=cpu-index TORCH_INDEX="$cpu_index"
        TORCH_WHY="pip would take torch $PICK_VERSION, a CUDA build ($PICK_URL), and there is no CUDA toolkit ($CUDA_FOUND_HOW): the CPU build from $cpu_index instead"
        return 0
    fi
    TORCH_STOP="pip would install torch $PICK_VERSION as a CUDA build ($PICK_URL, which needs NVIDIA's CUDA packages) and this machine has no CUDA toolkit ($CUDA_FOUND_HOW)"
    if [ -n "$TORCH_INDEX" ]; then
        TORCH_STOP+=" although TORCH_INDEX_URL=$TORCH_INDEX: point TORCH_INDEX_URL at an index of CPU builds ($HQ_CPU_INDEX_DEFAULT)"
    else
        TORCH_STOP+=", and PyTorch's CPU index $cpu_index is not reachable from here: either install torch's CPU build where that index (or a mirror) is reachable: TORCH_INDEX_URL=$HQ_CPU_INDEX_DEFAULT make setup"
    fi
    TORCH_STOP+=" ; or install a CUDA toolkit (nvcc) and run: CUDA_HOME=/path/to/cuda make setup"
}
