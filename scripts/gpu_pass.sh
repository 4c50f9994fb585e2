#!/usr/bin/env bash
# The one check-and-measure pass on a GPU machine, from the repository root:
#
#     bash scripts/gpu_pass.sh OUT [tests] [bench]      (no stage named: both, in that order)
#
# tests: every test of the repository with compiled kernels (TRITON_INTERPRET=0), into OUT/gpu-tests.log;
#        about 4-5 minutes on one H200.
# bench: the RMSNorm benchmark (scripts/bench_rmsnorm.py), its log, and its JSON and plots as OUT/bench.tgz;
#        about 4-5 minutes on one H200 (most of it compiling), less where the tests stage built the CUDA op.
# Each stage runs under a time limit, so that one that hangs still leaves the others' results; a
# device call of at most 10 minutes takes one stage. COMMIT=<hash> names the commit the benchmark
# records (a copied tree may not carry its git state).
set -u
out=${1:?usage: bash scripts/gpu_pass.sh OUT [tests] [bench]}
shift
stages=${*:-tests bench}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader

for stage in $stages; do
  echo "== $stage ($(date +%T))"
  start=$SECONDS
  case $stage in
    tests)
      timeout 540 python -m pytest -q tests > "$out/gpu-tests.log" 2>&1
      tail -n 3 "$out/gpu-tests.log" ;;
    bench)
      timeout 540 python scripts/bench_rmsnorm.py --out "$out/bench" ${COMMIT:+--commit "$COMMIT"} > "$out/bench.log" 2>&1
      tail -n 5 "$out/bench.log"
      tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench" ;;
    # decode: the decode benchmark (scripts/bench_generate.py) goes here, as its own stage.
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  echo "== $stage took $((SECONDS - start)) s"
done
