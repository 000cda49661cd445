"""Speculative decoding in the runtime: who proposes draft tokens and how the target's verify
pass accepts them (vLLM's ``v1/spec_decode`` + rejection sampler; TensorRT-LLM's
``_torch/speculative``).

- :mod:`.dflash`: :class:`~.dflash.DFlashProposer`, the DFlash drafter on the runner's paged
  pools: the target features each sequence has not yet ingested, one drafter forward per
  iteration for every drafting sequence (torch modules or the drafter kernels), greedy drafts
  (arXiv:2602.06036 §3);
- :mod:`.prompt_lookup`: prompt-lookup (n-gram) tokens written over the drafter's first drafts;
- :mod:`.verify`: the target's token after every logits row (argmax, or a sample with its
  request's uniform; stop tokens masked below ``min_tokens``) and each block's accepted prefix,
  on the device.

The runner (``runtime/model_runner.py``) keeps the KV pools, the target forward and CUDA graphs;
the engine (``runtime/engine.py``) schedules and commits.
"""
