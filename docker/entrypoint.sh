#!/bin/sh
# dflash-trt images' entrypoint: on a GPU image (DFLASH_TRT_CUDA_ARCHS set), check the GPUs
# against the image's architectures first (DFLASH_TRT_ARCH_CHECK=0 skips that); then run
# `dflash-trt` with the container's arguments.
set -eu
if [ -n "${DFLASH_TRT_CUDA_ARCHS:-}" ] && [ "${DFLASH_TRT_ARCH_CHECK:-1}" != 0 ]; then
    /opt/dflash-trt/check-gpu-arch.sh
fi
exec dflash-trt "$@"
