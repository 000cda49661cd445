"""The drafter plugin's kernels in Triton language, each with a torch reference that the CPU
path runs: context-K/V materialisation (:mod:`.context_kv`), KV-injected block attention
(:mod:`.block_attention`) and acceptance on the device (:mod:`.acceptance`). :mod:`.ops`
registers them as torch custom ops (``dflash::*``) and picks the implementation; :mod:`.aot`
compiles them ahead of time for Hopper and Blackwell."""
