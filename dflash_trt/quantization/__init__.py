"""FP8 / NVFP4 weight formats and calibration (NVIDIA ModelOpt)."""
