#!/usr/bin/env bash
# A/B of CUDA library variants on the GPU machine, side by side in one run (docs/gpu.md):
#   bash scripts/gpu_kernel_ab.sh NAME=SOURCE[:MIN_BLOCKS][+MACRO=VALUE...][,BENCHMARK_ARG...] ...
# Each variant is kernels/qsgd_cuda.cu's SOURCE (a path: this tree's file, or another tree's copy
# carried beside it) built for the visible GPU with QSGD_ENCODE_MIN_BLOCKS=MIN_BLOCKS (default: the
# source's own) and the macros after a '+' (e.g. fused=kernels/qsgd_cuda.cu+QSGD_FUSED_CHECKSUM=1), with
# setup.py's flags. The CPU library is built in place once; then the kernel
# benchmark runs once per variant in the order given (name the baseline first and last to see the
# drift between runs), each with that variant's library in place, every row checked against the CPU
# library; the arguments after a comma are added to that variant's benchmark command (e.g.
# nock=kernels/qsgd_cuda.cu,--no-checksum). AB_SIZES, AB_BITS, AB_ENCODERS choose the rows (default
# 64M,256M / 2,4,8 / 2); AB_NCU=1 (or a comma-separated list of names) adds ncu counts. Results
# under $OUT (default ./gpu_ab_out): ab.md (the runs' tables), one JSON per run, the build logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_ab_out}
WORK=${AB_WORK:-/tmp/gpu_ab}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HVD_QSGD_WITHOUT_TENSORFLOW=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
arch=${AB_ARCH:-$($PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")} || exit 2
suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
lib=hvd_qsgd/_lib_cuda$suffix

# the variants' libraries, compiled side by side, while the CPU library builds in place
declare -A built
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; rest=${rest%%,*}
  defs=""; case $rest in *+*) defs=${rest#*+}; rest=${rest%%+*} ;; esac
  src=${rest%%:*}; mb=${rest#"$src"}; mb=${mb#:}
  [ -n "${built[$name]:-}" ] && continue
  built[$name]=$WORK/$name/lib.so; mkdir -p "$WORK/$name"
  ( nvcc -O3 --fmad=false -std=c++17 -Xcompiler -fPIC -shared -cudart static \
      -gencode "arch=compute_$arch,code=sm_$arch" -Ikernels ${mb:+-DQSGD_ENCODE_MIN_BLOCKS=$mb} ${defs:+-D${defs//+/ -D}} -Xptxas -v \
      "$src" -o "$WORK/$name/lib.so" >"$OUT/build_$name.log" 2>&1 || echo "build of $name failed" ) &
done
HVD_QSGD_WITHOUT_CUDA=1 $PY setup.py -q build_ext --inplace >"$OUT/build_cpu.log" 2>&1 || echo "CPU library build failed"
wait
cp "$lib" "$WORK/in_place.so" 2>/dev/null
{
  echo "# CUDA kernel A/B, $(date -u +%Y-%m-%dT%H:%MZ): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  for name in "${!built[@]}"; do
    k=$(grep -A2 'encode_buckets_kernelILi4ELb0EfLb0E' "$OUT/build_$name.log")
    echo "- $name: 4-bit encode $(grep -o 'Used [0-9]* registers' <<<"$k" | head -1), $(grep -o '[0-9]* bytes spill stores' <<<"$k" | head -1)"
  done
} >"$OUT/ab.md"
run=0
for spec in "$@"; do
  name=${spec%%=*}; run=$((run + 1)); args=""
  case $spec in *,*) args=${spec#*,}; args=${args//,/ } ;; esac
  cp "${built[$name]}" "$lib" || continue
  echo "## run $run: $name${args:+ ($args)}" >>"$OUT/ab.md"
  $PY -m benchmarks kernels --device cuda --sizes "${AB_SIZES:-64M,256M}" --bits "${AB_BITS:-2,4,8}" \
    --encoder "${AB_ENCODERS:-2}" $args --json "$OUT/run${run}_$name.json" >"$WORK/run$run.log" 2>&1
  echo "exit $?" >>"$OUT/ab.md"
  sed -n '/^  size/,$p' "$WORK/run$run.log" | grep -v '^wrote' >>"$OUT/ab.md"
done
# AB_NCU: each variant's (or each named one's) 4-bit encoders (plain and error feedback) and decode
# under ncu, 64M elements
if [ "${AB_NCU:-0}" != 0 ] && command -v ncu >/dev/null; then
  for name in "${!built[@]}"; do
    [ "$AB_NCU" = 1 ] || case ",$AB_NCU," in *",$name,"*) ;; *) continue ;; esac
    cp "${built[$name]}" "$lib" || continue
    timeout 60 ncu --kernel-name regex:'encode_buckets|decode_sum_kernel|checksum_kernel' --metrics \
      smsp__inst_executed.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed \
      $PY scripts/gpu_profile.py $((64 << 20)) 4 512 2 >"$OUT/ncu_$name.log" 2>&1
    echo "## ncu: $name" >>"$OUT/ab.md"
    grep -E 'encode_buckets|decode_sum|inst_executed|duration|throughput' "$OUT/ncu_$name.log" | sed 's/(unnamed.*//' >>"$OUT/ab.md"
  done
fi
# the library that was in place before, or none
if [ -f "$WORK/in_place.so" ]; then cp "$WORK/in_place.so" "$lib"; else rm -f "$lib"; fi
cat "$OUT/ab.md"
