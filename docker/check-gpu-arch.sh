#!/bin/sh
# Check every visible GPU against the image's CUDA architectures (DFLASH_TRT_CUDA_ARCHS, e.g.
# "sm_90a" or "sm_100a,sm_103a"): arch-specific cubins (the "a" suffix) run only on exactly that
# compute capability. Reads the compute capability with nvidia-smi. Prints one line and exits 2
# when no GPU is visible or a GPU does not match; silent and 0 otherwise.
set -eu
archs="${DFLASH_TRT_CUDA_ARCHS:?DFLASH_TRT_CUDA_ARCHS is not set}"
image="dflash-trt:${DFLASH_TRT_FLAVOR:-gpu}"
if ! caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || [ -z "$caps" ]; then
    echo "$image: error: no NVIDIA GPU visible (nvidia-smi found none); this image needs a GPU of $archs (run with --device nvidia.com/gpu=all, or DFLASH_TRT_ARCH_CHECK=0 to skip this check)" >&2
    exit 2
fi
i=0
for cap in $caps; do
    sm="sm_$(printf '%s' "$cap" | tr -d '.')"
    found=0
    for arch in $(printf '%s' "$archs" | tr ',' ' '); do
        [ "${arch%a}" = "$sm" ] && found=1
    done
    if [ "$found" = 0 ]; then
        echo "$image: error: GPU $i has compute capability $cap ($sm), but this image's kernels are built for $archs only; use the image for that GPU generation (cpu, hopper: sm_90a, blackwell: sm_100a/sm_103a)" >&2
        exit 2
    fi
    i=$((i + 1))
done
