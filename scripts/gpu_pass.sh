#!/usr/bin/env bash
# One check-and-measure pass on a GPU machine, from the repository root:
#
#     bash scripts/gpu_pass.sh OUT [tests] [profile] [sweep] [bench]     (no stage named: all four)
#
# tests: the op and model tests with compiled kernels; profile: host time per piece and a fwd+bwd
# timeline; sweep: launch configs where they still matter; bench: the full RMSNorm benchmark.
# Everything lands in OUT as at most seven files (the benchmark's JSON and plots as one tarball).
# Each stage has a time limit, so that one that hangs still leaves the others' results.
# COMMIT=<hash> names the commit the benchmark records (a copied tree may not carry its git state).
set -u
out=${1:?usage: bash scripts/gpu_pass.sh OUT [tests] [profile] [sweep] [bench]}
shift
stages=${*:-tests profile sweep bench}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader

for stage in $stages; do
  echo "== $stage ($(date +%T))"
  case $stage in
    tests)
      timeout 300 python -m pytest -q -x tests/test_rmsnorm.py tests/test_rmsnorm_backward.py tests/test_model.py \
        tests/test_rmsnorm_launch.py tests/test_generation.py \
        > "$out/gpu-tests.log" 2>&1
      tail -n 2 "$out/gpu-tests.log" ;;
    profile)
      timeout 120 python scripts/profile_rmsnorm.py --trace "$out/trace.json" > "$out/profile.log" 2>&1
      head -n 40 "$out/profile.log" ;;
    sweep)
      timeout 240 python scripts/sweep_rmsnorm.py --quick --out "$out/sweep.json" 2>&1 | tee "$out/sweep.log" ;;
    bench)
      timeout 560 python scripts/bench_rmsnorm.py --out "$out/bench" ${COMMIT:+--commit "$COMMIT"} > "$out/bench.log" 2>&1
      tail -n 5 "$out/bench.log"
      tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
