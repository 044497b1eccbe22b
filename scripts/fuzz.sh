#!/usr/bin/env bash
# The codec's C ABI under AddressSanitizer and UndefinedBehaviorSanitizer: the CPU library (every ISA
# variant) and the CUDA library compiled for the host (tests/cuda_emu), driven by
# tests/fuzz/fuzz_codec.cc.
#
#   scripts/fuzz.sh replay             g++: the harness, sanitized; the kept inputs
#                                      (tests/fuzz/corpus.pack and tests/fuzz/regressions/) run
#                                      through it. Part of `make test` (tests/test_sanitizers.py).
#   scripts/fuzz.sh search [SECONDS]   clang's libFuzzer (Debian: clang, libclang-rt-14-dev and
#                                      libomp-14-dev), started from tests/fuzz/make_seeds.py's seeds
#                                      and the kept inputs, for SECONDS (default 600) on each of
#                                      JOBS processes (default: the cores but one); then the
#                                      smallest set of all of them that covers as much is packed
#                                      into tests/fuzz/corpus.pack. `make fuzz`. An input that
#                                      breaks a property is left as $BUILD/crash-* (add it to
#                                      tests/fuzz/regressions/ with the fix).
#   scripts/fuzz.sh library DIR        g++: the sanitized CPU library alone (DIR/_lib_cpu.so), to load
#                                      into Python (HVD_QSGD_CPU_LIB) with the runtimes preloaded.
#   scripts/fuzz.sh tf-ops DIR         g++: the TensorFlow op library (hvd_qsgd/tensorflow/qsgd_ops.cc
#                                      and the codec) with AddressSanitizer alone, against the
#                                      installed TensorFlow (DIR/_qsgd_ops.so, HVD_QSGD_TF_OPS_LIB):
#                                      UBSan's checks make TensorFlow's headers fail to compile.
#
# BUILD (default build/fuzz) holds what is built. The flags are setup.py's CPU_FLAGS (no FMA
# contraction: the shipped library's arithmetic) at -O1, with the sanitizers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build/fuzz}
PY=${PY:-.venv/bin/python}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
FLAGS="-O1 -ffp-contract=off -fno-math-errno -fno-trapping-math -Ikernels"
SOURCES="kernels/qsgd_cpu.cc kernels/qsgd_elias_cpu.cc kernels/qsgd_control.cc kernels/qsgd_chunks.cc"
VARIANTS="baseline:x86-64 sse4:x86-64-v2 avx2:x86-64-v3 avx512:x86-64-v4"
[ "$(uname -m)" = x86_64 ] || VARIANTS="generic:"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# a use of a stack frame after its return is caught too: the emulated warps' fibers announce their
# switches to ASan (tests/cuda_emu), whose swapcontext warning is then only a caution
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_stack_use_after_return=1}

# objects CXX EXTRA [emu]: the ISA variants' objects and, with emu, the emulated CUDA library's,
# compiled in parallel; prints their paths
objects() {
  local cxx=$1 extra=$2 dir="$BUILD/$(basename "$1")" objs="" pids=""
  mkdir -p "$dir"
  for v in $VARIANTS; do
    local name=${v%%:*} march=${v#*:}
    $cxx $FLAGS -std=c++17 -fopenmp $SAN $extra ${march:+-march=$march} -fPIC -c -DQSGD_ISA=$name \
      kernels/qsgd_cpu_isa.cc -o "$dir/isa_$name.o" >&2 & pids="$pids $!"
    objs="$objs $dir/isa_$name.o"
  done
  if [ "${3:-}" = emu ]; then
    $cxx $FLAGS -std=c++20 -x c++ $SAN $extra -fPIC -Itests/cuda_emu -c kernels/qsgd_cuda.cu \
      -o "$dir/cuda_emu.o" >&2 & pids="$pids $!"
    objs="$objs $dir/cuda_emu.o"
  fi
  for p in $pids; do wait "$p"; done
  echo "$objs"
}

case "${1:-replay}" in
  library)
    out=${2:?library DIR}
    mkdir -p "$out"
    objs=$(objects g++ "")
    g++ $FLAGS -std=c++17 -fopenmp $SAN -fPIC -shared $SOURCES $objs -o "$out/_lib_cpu.so"
    echo "$out/_lib_cpu.so"
    ;;
  tf-ops)
    out=${2:?tf-ops DIR}
    mkdir -p "$out"
    SAN="-fsanitize=address -fno-omit-frame-pointer -g"
    objs=$(objects g++ "")
    { read -r tf_flags; read -r tf_link; } < <($PY -c "import tensorflow as tf
print(' '.join(tf.sysconfig.get_compile_flags())); print(' '.join(tf.sysconfig.get_link_flags()))" 2>/dev/null)
    g++ $FLAGS -std=c++17 -fopenmp $SAN -fPIC -shared -Wno-deprecated-declarations $tf_flags \
      hvd_qsgd/tensorflow/qsgd_ops.cc $SOURCES $objs $tf_link -o "$out/_qsgd_ops.so"
    echo "$out/_qsgd_ops.so"
    ;;
  replay)
    objs=$(objects g++ "" emu)
    g++ $FLAGS -std=c++17 -fopenmp $SAN -DQSGD_FUZZ_CUDA_EMU $SOURCES $objs tests/fuzz/fuzz_codec.cc \
      tests/fuzz/replay.cc -o "$BUILD/replay"
    "$BUILD/replay" tests/fuzz/corpus.pack tests/fuzz/regressions
    ;;
  search)
    seconds=${2:-600}
    command -v clang++ >/dev/null || {
      echo "fuzz.sh search needs clang++ (Debian: apt-get install clang libclang-rt-14-dev libomp-14-dev)" >&2
      exit 2
    }
    objs=$(objects clang++ -fsanitize=fuzzer-no-link emu)
    clang++ $FLAGS -std=c++17 -fopenmp $SAN -fsanitize=fuzzer -DQSGD_FUZZ_CUDA_EMU $SOURCES $objs \
      tests/fuzz/fuzz_codec.cc -o "$BUILD/fuzz_codec"
    rm -rf "$BUILD/seeds" "$BUILD/kept" "$BUILD/merged"
    mkdir -p "$BUILD/work" "$BUILD/merged"
    PYTHONPATH=. $PY tests/fuzz/make_seeds.py "$BUILD/seeds"
    mkdir -p "$BUILD/kept"
    [ ! -f tests/fuzz/corpus.pack ] || $PY tests/fuzz/pack.py unpack tests/fuzz/corpus.pack "$BUILD/kept"
    cp tests/fuzz/regressions/* "$BUILD/kept/"
    jobs=${JOBS:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}
    status=0
    for j in $(seq "$jobs"); do
      "$BUILD/fuzz_codec" -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 \
        -artifact_prefix="$BUILD/" "$BUILD/work" "$BUILD/kept" "$BUILD/seeds" > "$BUILD/search-$j.log" 2>&1 &
    done
    for j in $(seq "$jobs"); do wait -n || status=$?; done
    grep -h "stat::number_of_executed_units" "$BUILD"/search-*.log || true
    "$BUILD/fuzz_codec" -merge=1 -artifact_prefix="$BUILD/" "$BUILD/merged" "$BUILD/kept" "$BUILD/work" "$BUILD/seeds" > "$BUILD/merge.log" 2>&1
    tail -1 "$BUILD/merge.log"
    $PY tests/fuzz/pack.py pack tests/fuzz/corpus.pack "$BUILD/merged"
    [ "$status" = 0 ] || echo "a search stopped on a violated property: $(ls "$BUILD"/crash-* 2>/dev/null)" >&2
    exit "$status"
    ;;
  *) echo "usage: scripts/fuzz.sh replay | search [SECONDS] | library DIR | tf-ops DIR" >&2; exit 2 ;;
esac
