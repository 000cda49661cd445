"""Peers measured in the same run (same process, prompts, dtype, batch 1) as our engine.

- ``hf``: plain greedy decoding with transformers' ``model.generate`` (KV cache on).
- ``prompt-lookup``: the same with ``prompt_lookup_num_tokens=10`` (transformers' n-gram
  prompt-lookup speculative decoding; greedy, so its output should equal ``hf``).

Each peer loads the HF checkpoint once (untimed), runs one short untimed warm-up generate, then
times every prompt's ``generate`` call with :func:`time.perf_counter` (prefill included; tokenizing,
tensor building and post-processing are outside the timed region).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DFlashError

PEERS = ("hf", "prompt-lookup", "zlab")

_PEER_KWARGS = {
    "hf": {},
    "prompt-lookup": {"prompt_lookup_num_tokens": 10},
    "zlab": {},
}

WARMUP_NEW_TOKENS = 4


@dataclass
class PeerResult:
    """What one peer produced and how long it took.

    Attributes:
        name: peer name (one of :data:`PEERS`).
        outputs: new token ids per prompt; a stop token, when reached, is the last one kept.
        new_tokens: total number of new tokens over all prompts.
        wall_s: summed wall time of the timed ``generate`` calls (seconds).
    """

    name: str
    outputs: list[list[int]]
    new_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of timed generate wall time."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _cut_at_stop(ids: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


def _load_model(hf_dir: Path, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise DFlashError(f"peer model {hf_dir}: no config.json (needs a HF checkpoint directory)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(f"peer model {hf_dir}: cannot load with transformers ({msg})") from None
    return model.to(device).eval()


def _zlab_generator(target, drafter, dtype, device, stops: list[int], block_size: int | None):
    """The z-lab reference loop bound to ``target`` and a z-lab copy of our ``drafter``."""
    if drafter is None:
        raise DFlashError("peer zlab needs a drafter")
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError:
        raise DFlashError("peer zlab needs the z-lab reference: pip install --no-deps dflash==0.1.0") from None
    from transformers import Qwen3Config

    from ..checkpoints.zlab import drafter_config_to_json

    ref = DFlashDraftModel(Qwen3Config(**drafter_config_to_json(drafter.cfg)))
    # z-lab drafts over the target's whole vocabulary: a draft vocabulary (d2t) is ours alone
    ref.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "d2t"}, strict=True)
    ref = ref.to(device=device, dtype=dtype).eval()
    K = block_size or drafter.cfg.block_size

    def generate(x: torch.Tensor, n: int) -> torch.Tensor:
        return dflash_generate(ref, target, x, n, stops, temperature=0.0, block_size=K)

    return generate


def run_peer(
    name: str,
    hf_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype,
    stop_token_ids: tuple[int, ...],
    *,
    device: str | torch.device = "cpu",
    drafter=None,
    block_size: int | None = None,
) -> PeerResult:
    """Run peer ``name`` greedily on ``prompts``, one at a time, and time it.

    Args:
        name: one of :data:`PEERS` (``"hf"``, ``"prompt-lookup"``, ``"zlab"``).
        hf_dir: HF checkpoint directory (``config.json`` + safetensors) that transformers loads.
        prompts: token ids per prompt (chat template already applied).
        max_new_tokens: cap on new tokens per prompt.
        dtype: model dtype (e.g. ``torch.float32``); use the same as the engine it is compared to.
        stop_token_ids: generation stops after any of these (it is kept as the last token).
            Empty means the model's own generation-config EOS.
        device: where to run the model (default CPU).
        drafter: our ``DFlashDrafter``, needed by ``"zlab"``: the z-lab reference loop
            (``dflash.model.dflash_generate``, PyPI ``dflash``) runs with the same weights on
            the transformers target.
        block_size: block size for ``"zlab"`` (default: the drafter's).

    Returns:
        :class:`PeerResult` with new tokens only, their total and the timed wall seconds.

    Raises:
        DFlashError: unknown peer, no prompts or an empty prompt, ``max_new_tokens`` < 1,
            or a checkpoint transformers cannot load.
    """
    if name not in _PEER_KWARGS:
        raise DFlashError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise DFlashError(f"peer {name}: no prompts")
    if any(len(p) == 0 for p in prompts):
        raise DFlashError(f"peer {name}: empty prompt")

    model = _load_model(hf_dir, dtype, device)
    gen_cfg = model.generation_config
    stops = [int(t) for t in stop_token_ids]
    if not stops:
        eos = gen_cfg.eos_token_id
        stops = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(t) for t in eos])
    pad = gen_cfg.pad_token_id
    if pad is None:
        pad = stops[0] if stops else 0
    kwargs = dict(
        do_sample=False,
        eos_token_id=stops or None,
        pad_token_id=int(pad),
        **_PEER_KWARGS[name],
    )
    on_cuda = torch.device(device).type == "cuda"

    def tensor(ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=device)

    def hf_generate(x: torch.Tensor, n: int) -> torch.Tensor:
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, **kwargs)

    generate = _zlab_generator(model, drafter, dtype, device, stops, block_size) if name == "zlab" else hf_generate

    stop_set = set(stops)
    outputs: list[list[int]] = []
    wall = 0.0
    with torch.inference_mode():
        generate(tensor(prompts[0]), min(WARMUP_NEW_TOKENS, max_new_tokens))  # warm-up, untimed
        for p in prompts:
            x = tensor(p)
            if on_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = generate(x, max_new_tokens)
            if on_cuda:
                torch.cuda.synchronize()
            wall += time.perf_counter() - t0
            outputs.append(_cut_at_stop(out[0, len(p) :].tolist(), stop_set))
    return PeerResult(name, outputs, sum(map(len, outputs)), wall)
