"""``LLM``: offline generation with DFlash speculative decoding, the package's front door (the
shape of vLLM's and TensorRT-LLM's ``LLM``)::

    from dflash_trt import LLM, SamplingParams

    llm = LLM(speculative_config={"method": "dflash", "num_speculative_tokens": 3}, dtype="fp32")
    for out in llm.chat([[{"role": "user", "content": "Why is the sky blue?"}]], SamplingParams(max_tokens=64)):
        print(out.outputs[0].text, out.spec_decode.acceptance_length)

Every prompt of a call is queued at once and decoded with in-flight batching; the output is
what the target alone would produce (lossless; bit for bit on the CPU in the batch-invariant
mode).
"""

from __future__ import annotations

from collections.abc import Sequence

from .engine_args import EngineArgs
from .errors import DFlashError
from .outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from .runtime.request import Request
from .runtime.sampling import SamplingParams


class LLM:
    """A target (with its DFlash drafter) loaded once, generating for lists of prompts.

    Args:
        model: the target: HF checkpoint directory, ``.gguf`` file, or an engine directory from
            ``dflash-trt build`` (which holds its drafter); None: the default SmolLM2-135M-Instruct.
        speculative_config: vLLM's form, ``{"method": "dflash", "model": DRAFTER_DIR,
            "num_speculative_tokens": N}`` (block size N + 1; ``model`` None: the default drafter;
            ``adaptive``, ``prompt_lookup`` also accepted), ``{"method": "none"}`` for plain
            decoding; None: DFlash with the default drafter at its own block size. The draft
            length is adaptive unless ``adaptive`` is False (here or in ``speculative_config``),
            as in ``dflash-trt serve``: up to N drafts per sequence and iteration, 0 (plain
            decoding) where drafting does not pay, e.g. at 16 sequences on a 2-core CPU, where
            always drafting ran at 0.4x plain decoding (55 against 139 tok/s, fp32).
        dtype: ``auto`` (an engine's build dtype, else the checkpoint's, bf16 for bf16 / fp32
            checkpoints), ``fp32``, ``bf16``, ``fp16``.
        device: ``cpu``, ``cuda``, ``cuda:N``; None: cuda when visible.
        tensor_parallel_size: TP ranks (under ``mpiexec`` the job's; else started here).
        **kwargs: any other :class:`~dflash_trt.engine_args.EngineArgs` field (``weights``,
            ``kv_capacity``, ``max_batch_size``, ``batch_invariant``, a mixture-of-experts target's
            ``moe_tensor_parallel_size`` / ``moe_expert_parallel_size``, ...).

    Raises:
        ConfigError: an impossible setting, named by its field.
        DFlashError: what loading raises (missing or mismatched checkpoints).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_config: dict | None = None,
        dtype: str = "auto",
        device: str | None = None,
        tensor_parallel_size: int = 1,
        **kwargs,
    ):
        from .runtime.engine_factory import create_engine

        kwargs.setdefault("adaptive", True)  # (serve's default too: never slower than plain by its model)
        self.engine_args = EngineArgs.from_speculative_config(
            speculative_config,
            model=model,
            dtype=dtype,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self.llm_engine = create_engine(self.engine_args)
        if self.llm_engine is None:  # pragma: no cover - a TP worker rank under mpiexec
            raise SystemExit(0)

    def get_tokenizer(self):
        """The target's HF tokenizer."""
        return self.llm_engine.models.target.tokenizer

    def generate(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt as it is (no chat template).

        Args:
            prompts: a text, a list of token ids, ``{"prompt": text}`` or
                ``{"prompt_token_ids": ids}``, or a list of those.
            sampling_params: one for every prompt, or one per prompt (default:
                ``SamplingParams()``).
            use_tqdm: a progress bar over finished requests.

        Returns:
            one :class:`~dflash_trt.outputs.RequestOutput` per prompt, in order.

        Raises:
            DFlashError: an empty prompt, token ids outside the vocabulary, a prompt that
                cannot fit the KV cache, a sampling-parameter list of another length.
        """
        tok = self.get_tokenizer()
        items = [_prompt(tok, p) for p in _as_list(prompts)]
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate an assistant turn for each conversation (a list of ``{"role", "content"}``
        messages, or a list of such lists) through the tokenizer's chat template.

        Raises:
            DFlashError: as :meth:`generate`; a tokenizer without a chat template.
        """
        from .prompts import chat_prompt_ids

        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        items = []
        for conv in convs:
            ids = chat_prompt_ids(tok, conv)
            items.append((tok.decode(ids), ids))
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        params = _params_for(sampling_params, len(items))
        engine = self.llm_engine
        tok = self.get_tokenizer()
        pending = [_Pending(str(i), text, ids, p, tok) for i, ((text, ids), p) in enumerate(zip(items, params))]
        eos = tuple(engine.stop_token_ids)
        for p in pending:  # checked up front: a bad prompt fails the call before any work
            engine.check_request(Request.from_params(p.prompt_ids, p.params, eos))
        for p in pending:
            p.seq_id = engine.add_request(
                Request.from_params(p.prompt_ids, p.params, eos), on_tokens=p.on_tokens, on_finish=p.on_finish
            )
            p.engine = engine
        with tqdm(total=len(pending), desc="requests", unit="req", disable=not use_tqdm or None, leave=False) as bar:
            while engine.has_unfinished():
                engine.step()
                bar.update(sum(p.done for p in pending) - bar.n)
        return [p.result() for p in pending]

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks this engine started (nothing otherwise)."""
        tp = getattr(self.llm_engine, "tp", None)
        if tp is not None:
            tp.stop_workers()
            tp.shutdown()
            self.llm_engine.tp = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Pending:
    """One prompt of an :meth:`LLM.generate` call while it decodes: its tokens, its stop strings
    (found in the incrementally decoded text; the request is aborted at the first), its result."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, tok):
        from .serving.detokenizer import IncrementalDetokenizer

        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.tok = tok
        self.detok = IncrementalDetokenizer(tok, list(params.stop)) if params.stop else None
        self.ids: list[int] = []
        self.stop_at: int | None = None  # tokens kept when a stop string ended the output
        self.output = None
        self.done = False
        self.seq_id = -1
        self.engine = None

    def on_tokens(self, _sid: int, tokens: list[int]) -> None:
        if self.stop_at is not None:
            return
        self.ids.extend(tokens)
        if self.detok is not None:
            self.detok.push(tokens)
            if self.detok.stopped:
                self.stop_at = self._stop_length()
                self.engine.abort(self.seq_id)

    def _stop_length(self) -> int:
        """The fewest tokens whose text holds a stop string (vLLM drops what comes after it)."""
        for n in range(max(1, len(self.ids) - 64), len(self.ids) + 1):
            text = self.tok.decode(self.ids[:n], skip_special_tokens=True)
            if any(s in text for s in self.params.stop):
                return n
        return len(self.ids)

    def on_finish(self, _sid: int, output) -> None:
        self.output, self.done = output, True

    def result(self) -> RequestOutput:
        out = self.output
        reason, stop_reason = out.finish_reason, None
        if self.stop_at is not None:
            ids = self.ids[: self.stop_at]
            text = self.detok.text + self.detok.finish()
            reason = "stop"
            stop_reason = next(
                (s for s in self.params.stop if s in self.tok.decode(ids, skip_special_tokens=True)), None
            )
        else:
            ids = out.output_ids
            text = self.tok.decode(ids, skip_special_tokens=True)
            if self.detok is not None:
                text = self.detok.text + self.detok.finish()
            if reason == "stop" and ids:
                stop_reason = ids[-1]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_ids,
            [CompletionOutput(0, text, list(ids), reason, stop_reason)],
            spec_decode=SpecDecodeStats.from_lengths(out.commit_lengths, out.draft_lengths, out.accepted_lengths),
            ttft_s=out.ttft_s,
            latency_s=out.latency_s,
        )


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _prompt(tok, p) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt in any accepted form.

    Raises:
        DFlashError: another form, or an empty prompt.
    """
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            p = list(p["prompt_token_ids"])
        elif "prompt" in p:
            p = p["prompt"]
        else:
            raise DFlashError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
    if isinstance(p, str):
        ids = tok.encode(p)
        text = p
    elif isinstance(p, list) and all(isinstance(t, int) for t in p):
        ids, text = p, None
    else:
        raise DFlashError(f"a prompt is a string, a list of token ids or a dict, got {type(p).__name__}")
    if not ids:
        raise DFlashError("empty prompt")
    return text, ids


def _params_for(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise DFlashError(f"{len(params)} sampling parameters for {n} prompts")
    return params
