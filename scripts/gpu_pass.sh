#!/usr/bin/env bash
# The one check-and-measure pass on a GPU machine, from the repository root:
#
#     bash scripts/gpu_pass.sh OUT [tests] [gpu-tests] [sampler-tests] [bench] [decode-0.6b] [decode-8b]
#                                  [decode-30b-a3b] [decode-kept] [sampled-decode] [serve] [serve-levels] [serve-256]
#                                  [serve-logprobs] [grammar] [structured] [structured-8b]
#                                  [scenarios] [engine] [server-loop] [tp]
#                                  [extend-attention] [long-prompts] [long-prompts-8b] [multi-turn-8b]
#                                  [fp8-linear] [fp8-tests] [decode-0.6b-fp8] [decode-8b-fp8] [decode-30b-a3b-fp8]
#                                                       (no stage named: tests, bench, decode-0.6b, decode-8b)
#
# tests: every test of the repository with compiled kernels (TRITON_INTERPRET=0), into OUT/gpu-tests.log,
#        in 4 worker processes sharing the GPU: about 3.6 minutes on one H200 (16 cores). gpu-tests: only the files with kernels or CUDA tests (~2-3 minutes).
#        sampler-tests: the sampler's, generation's and the engine's tests, into OUT/sampler-tests.log.
# bench: the RMSNorm benchmark (scripts/bench_rmsnorm.py), its log, and its JSON and plots as OUT/bench.tgz;
#        about 4-5 minutes on one H200 (most of it compiling), less where the tests stage built the CUDA op.
# decode-MODEL: scripts/bench_generate.py for one model at batch 1, 8, 32 and 64 (transformers at 1 and 64
#        for 0.6b, at 1 for 8b: its compile takes about a minute per shape), rows added to OUT/decode-h200.json;
#        ours greedy and sampled with the shipped model's settings (ours_sampled).
# sampled-decode: ours greedy and sampled only, 0.6b at batch 1 and 64 (about a minute).
#        decode-30b-a3b: the MoE model at batch 1 and 32 (transformers eagerly at 1), about 4 minutes.
# tp: on two GPUs (nvidia-h200-x2): the two-GPU test of tests/test_tensor_parallel.py (graphed fp32 greedy
#        tokens at tp=2 equal tp=1's) into OUT/tp-tests.log, then scripts/bench_generate.py --tp 2 under torchrun:
#        a greedy parity check (fp32, from_pretrained), then Qwen3-8B and 0.6B decode at batch 1 and 32, tp=1 and
#        tp=2 in the same run, rows into OUT/decode-tp-h200.json, log in OUT/decode-tp.log; about 5 minutes
#        (building the 8B model on each GPU takes most of a minute). NVLink multicast stays off.
# serve: scripts/bench_serve.py at the 0.6B config, 1, 20, 64 and 256 clients, into OUT/serve-h200.{json,png};
#        the clients in 8 processes, so that reading 256 streams does not hold the clients back (serve-notes.md).
#        The server's packages (fastapi, uvicorn, pydantic) are not on the device image: carry their
#        wheels in .whl/ and install them first (see docs/benchmarks/README.md).
# serve-levels: scripts/bench_serve.py at 20 and 256 clients, greedy, with Qwen3's recommended sampling and
#        with top-p alone, into OUT/serve-h200.{json,png} (about four minutes).
# decode-kept: ours alone (no transformers) at batch 1 and 64 for 0.6b, 8b and 30b-a3b, into
#        OUT/decode-kept.json: the decode levels kept, in one process (about six minutes).
# serve-256: scripts/bench_serve.py at 256 clients only, greedy, into OUT/serve-256.json (about a minute).
# grammar: scripts/bench_grammar.py, the grammars' host cost per step at 64 rows without a model, by xgrammar's
#        fill threads (Grammars fills on one; this checks that choice on this host), into OUT/grammar.log (about a minute).
# structured: scripts/bench_structured.py at the 0.6B config: 64 requests at once, each constrained to a
#        random JSON schema, against the same 64 unconstrained, into OUT/structured-0.6b.log (about a minute);
#        structured-8b: the same at the 8B config.
# server-loop: scripts/bench_server_loop.py, the HTTP server over a stub engine (no model, no GPU work) at
#        256 clients in 8 processes, without and with `logprobs: 5`: this host's server CPU per streamed
#        token, what bounds serve-256 (serve-notes.md), into OUT/server-loop.log (about a minute).
# serve-logprobs: serve-256 twice in a row, without log-probabilities and with `logprobs: 5` on every
#        request, into OUT/serve-logprobs-{none,5}.json (about three minutes); where py-spy is installed
#        (its wheel carried), 3 s of the server's and the engine's stacks in OUT/spy-{none,5}/.
# scenarios: scripts/bench_scenarios.py at the 0.6B config: the multi-turn chat with the prefix cache on and
#        off, then long prompts (16k, 32k) among 64 streams, into OUT/scenarios-*.json (about 4 minutes).
# extend-attention: scripts/bench_extend_attention.py: the paged chunk-attention kernel's tile configurations
#        (EXTEND_CONFIGS="rows,keys,warps,stages ...") against SDPA at 4k-32k, 0.6B and 8B heads (about 2 minutes).
# long-prompts, long-prompts-8b, multi-turn-8b: one scenario of bench_scenarios.py at that config.
# fp8-linear: scripts/bench_fp8_linear.py: the FP8 products at Qwen3-8B's shapes against bf16, 1 to 2,048 rows
#        (about a minute). fp8-tests: tests/test_fp8*.py.
# decode-MODEL-fp8 (0.6b, 8b, 30b-a3b): bench_generate.py --quantization fp8, ours greedy and sampled, batch 1
#        and 64 (30b-a3b: 1 and 32), and the 2,048-token prefill in FP8 and bf16; rows "qwen3-MODEL-fp8".
# engine: scripts/bench_engine.py, the serving engine in-process (no HTTP) under the same load at 20 and
#        256 clients, greedy, with Qwen3's recommended sampling (temperature 0.6, top-p 0.95, top-k 20) and
#        with top-p alone (temperature 1, top-p 0.95), into OUT/engine.log: what the served run is compared
#        with (about two minutes).
# The tests stage runs 4 workers; the others one process (-n 0). A stage's time limit interrupts pytest
# with SIGINT, so that a log cut short still ends with the failures so far.
# Each stage runs under a time limit, so that one that hangs still leaves the others' results; a
# device call of at most 10 minutes takes one stage. COMMIT=<hash> names the commit the benchmark
# records (a copied tree may not carry its git state).
set -u
out=${1:?usage: bash scripts/gpu_pass.sh OUT [tests] [bench]}
shift
stages=${*:-tests bench decode-0.6b decode-8b}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader

for stage in $stages; do
  echo "== $stage ($(date +%T))"
  start=$SECONDS
  case $stage in
    tests)
      timeout -s INT ${TESTS_S:-540} python -m pytest -q -n 4 tests > "$out/gpu-tests.log" 2>&1
      tail -n 3 "$out/gpu-tests.log" ;;
    sampler-tests)
      timeout -s INT 400 python -m pytest -q -n 0 tests/test_sampler.py tests/test_sampling.py tests/test_generation.py \
        tests/test_engine.py > "$out/sampler-tests.log" 2>&1
      tail -n 3 "$out/sampler-tests.log" ;;
    sampled-decode)
      timeout 300 python scripts/bench_generate.py --models 0.6b --batches 1 64 --engines ours ours_sampled \
        --long-prompt 0 --json "$out/decode-h200.json" ${COMMIT:+--commit "$COMMIT"} >> "$out/decode.log" 2>&1
      grep '^{' "$out/decode.log" | tail -n 4 ;;
    gpu-tests)
      timeout -s INT 540 python -m pytest -q -n 0 tests/test_rmsnorm.py tests/test_rmsnorm_backward.py tests/test_decode_ops.py \
        tests/test_model.py tests/test_generation.py tests/test_sampling.py tests/test_moe.py tests/test_engine.py \
        tests/test_kernels_compile.py > "$out/gpu-tests.log" 2>&1
      tail -n 3 "$out/gpu-tests.log" ;;
    bench)
      timeout 540 python scripts/bench_rmsnorm.py --out "$out/bench" ${COMMIT:+--commit "$COMMIT"} > "$out/bench.log" 2>&1
      tail -n 5 "$out/bench.log"
      tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench" ;;
    fp8-linear)
      timeout 300 python scripts/bench_fp8_linear.py > "$out/fp8-linear.log" 2>&1
      cat "$out/fp8-linear.log" ;;
    fp8-tests)
      timeout -s INT 400 python -m pytest -q -n 4 tests/test_fp8.py tests/test_fp8_kernels.py > "$out/fp8-tests.log" 2>&1
      tail -n 5 "$out/fp8-tests.log" ;;
    decode-kept)
      timeout 540 python scripts/bench_generate.py --models 0.6b 8b 30b-a3b --batches 1 64 --engines ours \
        --long-prompt 0 --json "$out/decode-kept.json" ${COMMIT:+--commit "$COMMIT"} >> "$out/decode.log" 2>&1
      grep '^{' "$out/decode.log" | tail -n 6 ;;
    decode-*-fp8)
      model=${stage#decode-}; model=${model%-fp8}
      batches=$([ "$model" = 30b-a3b ] && echo "1 32" || echo "1 64")
      timeout 540 python scripts/bench_generate.py --models "$model" --quantization fp8 --batches $batches \
        --engines ours ours_sampled --json "$out/decode-h200.json" ${COMMIT:+--commit "$COMMIT"} \
        >> "$out/decode.log" 2>&1
      grep -v '^{' "$out/decode.log" | grep fp8 | tail -n 2; grep '^{' "$out/decode.log" | tail -n 5 ;;
    decode-30b-a3b)
      timeout 540 python scripts/bench_generate.py --models 30b-a3b --batches 1 32 --hf-batches 1 \
        --engines ours ours_eager hf_eager --json "$out/decode-h200.json" ${COMMIT:+--commit "$COMMIT"} >> "$out/decode.log" 2>&1
      grep '^{' "$out/decode.log" | tail -n 8 ;;
    decode-*)
      model=${stage#decode-}
      hf_batches=$([ "$model" = 0.6b ] && echo "1 64" || echo 1)
      timeout 540 python scripts/bench_generate.py --models "$model" --batches 1 8 32 64 --hf-batches $hf_batches \
        --json "$out/decode-h200.json" ${COMMIT:+--commit "$COMMIT"} >> "$out/decode.log" 2>&1
      grep '^{' "$out/decode.log" | tail -n 12 ;;
    tp)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      timeout 120 python -m pytest -q tests/test_tensor_parallel.py -k cuda_graph > "$out/tp-tests.log" 2>&1
      tail -n 3 "$out/tp-tests.log"
      timeout 400 python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_generate.py --tp 2 \
        --models 8b 0.6b --batches 1 32 --parity --json "$out/decode-tp-h200.json" ${COMMIT:+--commit "$COMMIT"} \
        > "$out/decode-tp.log" 2>&1
      grep -e '^{' -e 'TensorParallel' "$out/decode-tp.log" | tail -n 12 ;;
    serve)
      timeout 540 python scripts/bench_serve.py --config 0.6b --concurrency 1 20 64 256 --client-processes 8 \
        ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/serve-h200.json" --plot "$out/serve-h200.png" --server-log "$out/server.log" > "$out/serve.log" 2>&1
      tail -n 8 "$out/serve.log" ;;
    serve-levels)
      timeout 540 python scripts/bench_serve.py --config 0.6b --concurrency 20 256 --client-processes 8 \
        --temperature 0 0.6 1 --top-p 1 0.95 0.95 --top-k 0 20 0 ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/serve-h200.json" --plot "$out/serve-h200.png" --server-log "$out/server.log" > "$out/serve.log" 2>&1
      grep '^{' "$out/serve.log" ;;
    serve-256)
      timeout 200 python scripts/bench_serve.py --config 0.6b --concurrency 256 --client-processes 8 \
        ${COMMIT:+--commit "$COMMIT"} --json "$out/serve-256.json" --server-log "$out/server-256.log" > "$out/serve-256.log" 2>&1
      grep '^{' "$out/serve-256.log" ;;
    serve-logprobs)
      for lp in none 5; do
        timeout 200 python scripts/bench_serve.py --config 0.6b --concurrency 256 --client-processes 8 \
          $([ $lp = none ] || echo --logprobs $lp) $(command -v py-spy > /dev/null && echo --py-spy "$out/spy-$lp") \
          ${COMMIT:+--commit "$COMMIT"} --json "$out/serve-logprobs-$lp.json" \
          --server-log "$out/server-logprobs-$lp.log" > "$out/serve-logprobs-$lp.log" 2>&1
        grep '^{' "$out/serve-logprobs-$lp.log"
      done ;;
    grammar)
      timeout 200 python scripts/bench_grammar.py --fill-threads 1 2 4 8 --repeats 2 > "$out/grammar.log" 2>&1
      grep '^{' "$out/grammar.log" ;;
    structured|structured-8b)
      config=$([ "$stage" = structured ] && echo 0.6b || echo 8b)
      timeout 300 python scripts/bench_structured.py --config $config --requests 64 --output 256 \
        > "$out/structured-$config.log" 2>&1
      tail -n 3 "$out/structured-$config.log" ;;
    scenarios)
      timeout 200 python scripts/bench_scenarios.py --config 0.6b --scenario multi_turn ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/scenarios-multi-turn.json" > "$out/scenarios.log" 2>&1
      timeout 150 python scripts/bench_scenarios.py --config 0.6b --scenario long_prompts ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/scenarios-long.json" >> "$out/scenarios.log" 2>&1
      grep '^{' "$out/scenarios.log" ;;
    extend-attention)
      timeout 300 python scripts/bench_extend_attention.py ${EXTEND_CONFIGS:+--configs $EXTEND_CONFIGS} ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/extend-attention.json" > "$out/extend-attention.log" 2>&1
      cat "$out/extend-attention.log" ;;
    long-prompts|long-prompts-8b)
      config=$([ "$stage" = long-prompts ] && echo 0.6b || echo 8b)
      timeout 300 python scripts/bench_scenarios.py --config "$config" --scenario long_prompts ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/scenarios-long-$config.json" >> "$out/scenarios.log" 2>&1
      grep '^{' "$out/scenarios.log" | tail -n 4 ;;
    multi-turn-8b)
      timeout 300 python scripts/bench_scenarios.py --config 8b --scenario multi_turn ${COMMIT:+--commit "$COMMIT"} \
        --json "$out/scenarios-multi-turn-8b.json" >> "$out/scenarios.log" 2>&1
      grep '^{' "$out/scenarios.log" | tail -n 4 ;;
    engine)
      timeout 400 python scripts/bench_engine.py --config 0.6b --concurrency 20 256 --temperature 0 0.6 1 \
        --top-p 1 0.95 0.95 --top-k 0 20 0 > "$out/engine.log" 2>&1
      grep '^{' "$out/engine.log" ;;
    server-loop)
      for lp in "" "--logprobs 5"; do
        timeout 200 python scripts/bench_server_loop.py --concurrency 256 --client-processes 8 $lp >> "$out/server-loop.log" 2>&1
      done
      grep '^{' "$out/server-loop.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  echo "== $stage took $((SECONDS - start)) s"
done
