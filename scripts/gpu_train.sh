#!/usr/bin/env bash
# Drafter training on ONE offline GPU (H100/H200 class: torch + CUDA, transformers, safetensors,
# tokenizers; no network, no model weights): self-distilled data from the target with our runtime
# at large batch, the DFlash training recipe time-boxed, then the trained drafter benchmarked
# against plain decoding on the evaluation prompts. README: "Training a drafter on a GPU".
#
#   scripts/gpu_train.sh PACK WORK
#     PACK  folder written by `dflash-trt pack` (its model-NN/ folders may arrive in separate transfers)
#     WORK  output folder: model/, data/ (the self-distilled dataset), run/ (log.jsonl, loss.png,
#           checkpoints, drafter/), bench/<set>.json, and steps.log (what ran, with timings)
#
# Settings (environment variables, defaults in brackets):
#   DEVICE [cuda]  DTYPE [bf16]  PYTHON [python3]  WHEELS [none: a folder of extra wheels, e.g. gguf]
#   distill: DISTILL_MINUTES [4]  NUM_PROMPTS [all]  BATCH [384]  MAX_NEW_TOKENS [256]  SHARD_SIZE [512]
#            MAX_NUM_TOKENS [16384]
#   train:   TRAIN_MINUTES [10]  STEPS [100000]  LAYERS [2]  BLOCK [8]  TARGET_LAYERS [1,7,14,21,27]
#            TRAIN_BATCH [16]  ANCHORS [512]  CE_CHUNK [8192]  FEATURE_CACHE_GB [40]  SAVE_EVERY [200]
#            DRAFT_VOCAB [8192]  HOLDOUT [0.02]  EXTRA_DATA [none: more data dirs, e.g. text-data output]
#            INIT_DRAFTER [none: start from this drafter]  TRAIN_ARGS [none: more train flags, e.g. --lr 4e-4]
#   bench:   BENCH_PROMPTS [20]  BENCH_TOKENS [128]  BENCH_SETS [gsm8k humaneval mtbench]  CONCURRENCY [none: e.g. 1,8,32]
source "$(dirname "$0")/gpu_common.sh"
need_model

step distill cli distill --target "$MODEL" --prompts-file "$PACK/prompts/sharegpt.jsonl" \
  ${NUM_PROMPTS:+--num-prompts "$NUM_PROMPTS"} --out "$WORK/data" --batch "${BATCH:-384}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-256}" --shard-size "${SHARD_SIZE:-512}" \
  --max-num-tokens "${MAX_NUM_TOKENS:-16384}" --max-minutes "${DISTILL_MINUTES:-4}" --device "$DEVICE" --dtype "$DTYPE"
step train cli train --target "$MODEL" --data "$WORK/data" ${EXTRA_DATA:-} --out "$WORK/run" --steps "${STEPS:-100000}" \
  --max-minutes "${TRAIN_MINUTES:-10}" --layers "${LAYERS:-2}" --block-size "${BLOCK:-8}" \
  --target-layers "${TARGET_LAYERS:-1,7,14,21,27}" --batch "${TRAIN_BATCH:-16}" --anchors "${ANCHORS:-512}" \
  --ce-chunk "${CE_CHUNK:-8192}" --feature-cache-gb "${FEATURE_CACHE_GB:-40}" --save-every "${SAVE_EVERY:-200}" \
  --draft-vocab "${DRAFT_VOCAB:-8192}" --holdout "${HOLDOUT:-0.02}" \
  ${INIT_DRAFTER:+--init-drafter "$INIT_DRAFTER"} ${TRAIN_ARGS:-} --device "$DEVICE" --dtype "$DTYPE"
mkdir -p "$WORK/bench"
for set in ${BENCH_SETS:-gsm8k humaneval mtbench}; do
  step "bench $set" cli bench --target "$MODEL" --drafter "$WORK/run/drafter" --prompts-file "$PACK/prompts/$set.jsonl" \
    --num-prompts "${BENCH_PROMPTS:-20}" --max-new-tokens "${BENCH_TOKENS:-128}" --device "$DEVICE" --dtype "$DTYPE" \
    --json "$WORK/bench/$set.json"
done
if [ -n "${CONCURRENCY:-}" ]; then
  step "load bench" cli bench --target "$MODEL" --drafter "$WORK/run/drafter" --prompts-file "$PACK/prompts/gsm8k.jsonl" \
    --num-prompts 32 --max-new-tokens "${BENCH_TOKENS:-128}" --concurrency "$CONCURRENCY" --device "$DEVICE" \
    --dtype "$DTYPE" --json "$WORK/bench/load.json"
fi
echo "== all done" | tee -a "$LOG"
