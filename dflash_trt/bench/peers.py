"""Peers measured in the same run (same process, prompts, dtype, batch 1) as our engine.

- ``hf``: plain greedy decoding with transformers' ``model.generate`` (KV cache on).
- ``prompt-lookup``: the same with ``prompt_lookup_num_tokens=10`` (transformers' n-gram
  prompt-lookup speculative decoding; greedy, so its output should equal ``hf``).
- ``zlab``: the z-lab reference loop (PyPI ``dflash``) with our drafter's weights.
- ``llama.cpp``: llama-cpp-python (``make peers`` builds it from its sdist) on the target's own
  GGUF file, the same prompt token ids, greedy (argmax of its logits), ``n_threads`` = torch's
  thread count; prefill (one ``eval`` of the prompt) and decode (one ``eval`` per new token)
  are timed apart. It runs in a child process (:class:`LlamaCppSession`) that ``bench`` keeps up
  and interleaves with our modes prompt by prompt. Two rows: ``llama.cpp`` keeps the file's
  block layout, ``llama.cpp-repack`` lets ggml repack the weights for its GEMMs (its default;
  a crash in it, seen on an AMX Xeon, ends that row only).
- ``vllm``: vLLM's CPU build in its own environment (``make peers``), plain decoding and its DFlash
  proposer with our drafter's weights, after our modes (:mod:`.vllm_peer`); rows ``vllm`` and
  ``vllm-dflash``.

Each peer loads the HF checkpoint once (untimed), runs one short untimed warm-up generate, then
times every prompt's ``generate`` call with :func:`time.perf_counter` (prefill included; tokenizing,
tensor building and post-processing are outside the timed region).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DFlashError

PEERS = ("hf", "prompt-lookup", "zlab", "llama.cpp", "vllm")

_PEER_KWARGS = {
    "hf": {},
    "prompt-lookup": {"prompt_lookup_num_tokens": 10},
    "zlab": {},
    "llama.cpp": {},
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
    #: ``llama.cpp`` only: prompt tokens and seconds of the prompt evals, and seconds of the
    #: one-token evals after them (``new_tokens - len(prompts)`` tokens: the first new token
    #: comes from the prefill's logits)
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    #: a speculative peer's acceptance length (tokens per target verify), as the peer counts it
    acceptance_length: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of timed generate wall time."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens per second of prefill (None when the peer does not time it apart)."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the one-token decode steps (None when not timed apart)."""
        steps = self.new_tokens - len(self.outputs)
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else None


def cut_at_stop(ids: list[int], stops: set[int]) -> list[int]:
    """``ids`` up to and including the first stop token (all of them without one)."""
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
    from ..quantization.packed import dense_state_dict

    ref = DFlashDraftModel(Qwen3Config(**drafter_config_to_json(drafter.cfg)))
    # z-lab drafts over the target's whole vocabulary: a draft vocabulary (d2t) is ours alone
    # the weights our drafter runs (a packed one's as its GEMMs multiply by them)
    own = dense_state_dict(drafter)
    ref.load_state_dict({k: v for k, v in own.items() if k != "d2t"}, strict=True)
    ref = ref.to(device=device, dtype=dtype).eval()
    K = block_size or drafter.cfg.block_size

    def generate(x: torch.Tensor, n: int) -> torch.Tensor:
        return dflash_generate(ref, target, x, n, stops, temperature=0.0, block_size=K)

    return generate


#: llama-cpp-python version ``make peers`` installs
LLAMA_CPP_VERSION = "0.3.36"


def require_llama_cpp() -> None:
    """Raises DFlashError when llama-cpp-python is not installed (``make peers``)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise DFlashError(f"peer llama.cpp needs llama-cpp-python=={LLAMA_CPP_VERSION}: run `make peers`")


def _llama_cpp_generator(
    gguf: Path, n_ctx: int, stop_token_ids: tuple[int, ...], threads: int, repack: bool = False
) -> Callable[[list[int], int], tuple[list[int], float, float]]:
    """Load ``gguf`` into llama.cpp (llama-cpp-python) and return ``one(prompt_ids, max_new_tokens)``:
    greedy decoding of one prompt, ``(new token ids, prefill seconds, decode seconds)``.

    Per prompt: ``Llama.reset()``, one timed ``eval(prompt)`` (prefill), then argmax of the
    last logits, ``eval([token])`` per new token (decode) until ``max_new_tokens`` or a stop
    token (kept). Logits: ``llama_get_logits_ith(ctx, -1)`` (fp32, the last evaluated token).

    Raises:
        DFlashError: llama-cpp-python not installed (``make peers``), or a file it cannot load.
    """
    require_llama_cpp()
    import llama_cpp

    # ggml's extra weight buffers (repacked layouts: AMX tiles, or interleaved Q4 blocks for its
    # AVX2 / AVX-512 GEMMs) only with ``repack``: on an AMX Xeon the first eval on its AMX buffer
    # of this file segfaulted (general protection fault in libggml-cpu), so the ``llama.cpp`` peer
    # keeps the file's Q4_1 / Q8_0 layout and ``llama.cpp-repack`` runs llama.cpp's default
    import llama_cpp.llama_cpp as capi
    import numpy as np

    defaults = capi.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = repack
        return params

    capi.llama_model_default_params = model_params  # what Llama() builds its params from
    try:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=min(2048, n_ctx),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
    except (ValueError, RuntimeError) as e:
        raise DFlashError(f"peer llama.cpp: cannot load {gguf} ({e})") from None
    stops = {int(t) for t in stop_token_ids}
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # llama-cpp-python 0.3.x no longer copies logits into ``Llama.scores`` without
        # logits_all: read the context's logits of the last evaluated token (llama.h API)
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    def one(p: list[int], n: int) -> tuple[list[int], float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(p)
        t1 = time.perf_counter()
        out: list[int] = []
        while True:
            tok = int(np.argmax(last_logits()))
            out.append(tok)
            if len(out) >= n or tok in stops:
                break
            llm.eval([tok])
        return out, t1 - t0, time.perf_counter() - t1

    return one


def _llama_cpp_serve(conn, *args) -> None:
    """The child process of :class:`LlamaCppSession`: load the model, then answer
    ``(prompt_ids, max_new_tokens)`` jobs until it receives None."""
    try:
        one = _llama_cpp_generator(*args)
    except DFlashError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", None))
    while (job := conn.recv()) is not None:
        conn.send(("ok", one(*job)))


class LlamaCppSession:
    """llama.cpp on a GGUF file in a child process (``spawn``) that stays up between prompts, so
    that a benchmark can interleave it prompt by prompt with our own modes (a slow period of a
    shared machine then falls on every mode alike), and so that a crash in llama.cpp's native
    code (seen: a segfault in ggml's AMX weight repacking on an AMX Xeon) ends the peer, not the
    benchmark. The child waits on its pipe between prompts: it uses no CPU while ours run.

    Args:
        gguf: the model file; n_ctx: llama.cpp's context length (longest prompt + new tokens);
        stop_token_ids: a new token among these ends the prompt's generation (it is kept);
        threads: llama.cpp's ``n_threads`` and ``n_threads_batch``.
        repack: ggml's repacked weight buffers (``use_extra_bufts``) on.

    Raises:
        DFlashError: llama-cpp-python not installed (``make peers``), a file it cannot load,
            or the child died (its exit code); also from :meth:`generate`.
    """

    def __init__(self, gguf: Path, n_ctx: int, stop_token_ids: tuple[int, ...], threads: int, repack: bool = False):
        import multiprocessing

        require_llama_cpp()
        self.gguf = Path(gguf)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        args = (child_end, self.gguf, n_ctx, tuple(int(t) for t in stop_token_ids), threads, repack)
        self._child = ctx.Process(target=_llama_cpp_serve, args=args, daemon=True)
        self._child.start()
        child_end.close()  # the child's copy stays open: its death is our EOF
        self._receive()

    def _receive(self):
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._child.join()
            raise DFlashError(
                f"peer llama.cpp crashed (exit code {self._child.exitcode}) on {self.gguf.name}: a fault in "
                "llama-cpp-python's native code; rebuild it with `make peers`"
            ) from None
        if status == "error":
            self.close()
            raise DFlashError(value)
        return value

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """Greedy decoding of one prompt: ``(new token ids, prefill seconds, decode seconds)``."""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # gone: _receive says how it ended
            self._conn.send((list(prompt_ids), max_new_tokens))
        return self._receive()

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self._child.is_alive():
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._conn.send(None)
            self._child.join(30)
            if self._child.is_alive():
                self._child.kill()
                self._child.join()
        self._conn.close()

    def __enter__(self) -> LlamaCppSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def llama_cpp_result(
    prompts: list[list[int]], runs: list[tuple[list[int], float, float]], name: str = "llama.cpp"
) -> PeerResult:
    """The :class:`PeerResult` of :meth:`LlamaCppSession.generate` results, one per prompt."""
    outputs = [r[0] for r in runs]
    pre, dec = sum(r[1] for r in runs), sum(r[2] for r in runs)
    return PeerResult(name, outputs, sum(map(len, outputs)), pre + dec, sum(map(len, prompts)), pre, dec)


def open_llama_cpp(
    gguf: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    threads: int,
    repack: bool = False,
) -> LlamaCppSession:
    """A :class:`LlamaCppSession` sized for ``prompts`` (context: the longest prompt plus
    ``max_new_tokens``), after one short untimed warm-up generate on ``prompts[0]``; ``repack``:
    ggml's repacked weight buffers on (llama.cpp's default; off: the file's own block layout).

    Raises:
        DFlashError: ``gguf`` is not a GGUF file (llama.cpp runs the target's own file), or as
            :class:`LlamaCppSession`.
    """
    if gguf is None or Path(gguf).suffix != ".gguf":
        raise DFlashError("peer llama.cpp runs a GGUF target: use the default target or --target FILE.gguf")
    n_ctx = max(map(len, prompts)) + max_new_tokens + 8
    llm = LlamaCppSession(Path(gguf), n_ctx, stop_token_ids, threads, repack)
    try:
        llm.generate(prompts[0], min(WARMUP_NEW_TOKENS, max_new_tokens))  # warm-up, untimed
    except DFlashError:
        llm.close()
        raise
    return llm


def run_llama_cpp_isolated(
    gguf: Path | None, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: tuple[int, ...], threads: int
) -> PeerResult:
    """Every prompt through :func:`open_llama_cpp`'s session, one after the other.

    Raises:
        DFlashError: as :func:`open_llama_cpp`.
    """
    with open_llama_cpp(gguf, prompts, max_new_tokens, stop_token_ids, threads) as llm:
        return llama_cpp_result(prompts, [llm.generate(p, max_new_tokens) for p in prompts])


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
    gguf: Path | None = None,
) -> PeerResult:
    """Run peer ``name`` greedily on ``prompts``, one at a time, and time it.

    Args:
        name: ``"hf"``, ``"prompt-lookup"``, ``"zlab"`` or ``"llama.cpp"`` (``"vllm"`` runs
            through :func:`~.vllm_peer.run_vllm`).
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
        gguf: the target's GGUF file, needed by ``"llama.cpp"`` (:func:`run_llama_cpp_isolated`: a
            child process, with torch's thread count; ``dtype`` and ``device`` do not apply:
            llama.cpp runs the file's own types on the CPU).

    Returns:
        :class:`PeerResult` with new tokens only, their total and the timed wall seconds.

    Raises:
        DFlashError: unknown peer, no prompts or an empty prompt, ``max_new_tokens`` < 1,
            a checkpoint transformers cannot load, or llama.cpp failing or crashing.
    """
    if name not in _PEER_KWARGS:
        raise DFlashError(f"unknown peer {name!r}; choose from {', '.join(_PEER_KWARGS)}")
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise DFlashError(f"peer {name}: no prompts")
    if any(len(p) == 0 for p in prompts):
        raise DFlashError(f"peer {name}: empty prompt")
    if name == "llama.cpp":
        return run_llama_cpp_isolated(gguf, prompts, max_new_tokens, stop_token_ids, torch.get_num_threads())

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
            outputs.append(cut_at_stop(out[0, len(p) :].tolist(), stop_set))
    return PeerResult(name, outputs, sum(map(len, outputs)), wall)
