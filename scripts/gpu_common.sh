# Sourced by scripts/gpu_train.sh and scripts/gpu_validate.sh (both take PACK WORK): the shared
# start of a procedure on an offline GPU machine. Sets PACK, WORK, REPO, PY, DEVICE, DTYPE, LOG,
# installs WHEELS (a folder of extra wheels, e.g. gguf) under WORK/site, defines `step` (run a
# command, log it and its wall time in WORK/steps.log), `cli` (dflash-trt from this checkout) and
# `need_model` (joins the pack's model parts into MODEL, checked against the pack's sha256, once;
# the stages that need no model run before all the parts have arrived).
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 PACK WORK" >&2; exit 2; fi
PACK=$(cd "$1" && pwd)
mkdir -p "$2"; WORK=$(cd "$2" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bf16}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DFLASH_TRT_CACHE="$WORK/cache"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl
  export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
LOG="$WORK/steps.log"
step() {  # step NAME CMD...: run, log the command and its wall time; returns the command's status
  local name=$1; shift
  local t0=$SECONDS rc=0
  echo "== $name: $*" | tee -a "$LOG"
  "$@" || rc=$?
  if [ $rc -ne 0 ]; then
    echo "== $name: FAILED (exit $rc) after $((SECONDS - t0)) s" | tee -a "$LOG"
    return $rc
  fi
  echo "== $name: done in $((SECONDS - t0)) s" | tee -a "$LOG"
}
cli() { "$PY" -m dflash_trt.cli "$@"; }

MODEL=
need_model() {
  if [ -z "$MODEL" ]; then MODEL=$(cli unpack --pack "$PACK" --dest "$WORK/model"); fi
}
