"""The Triton Inference Server python-backend model ``dflash`` (decoupled): our in-flight-batching
engine behind TensorRT-LLM's ``ensemble`` / ``tensorrt_llm_bls`` tensor names, so clients written
for those models work unchanged (../shared/SERVING.md "Triton model").

Threads, after TensorRT-LLM's python-backend ``tensorrt_llm/1/model.py``: ``execute`` checks each
request and enqueues it in the engine, then returns None; the engine is stepped on its own
thread, which sends the responses from the engine's token callbacks; a cancellation thread polls
``response_sender.is_cancelled()`` every ``cancellation_check_period_ms`` and aborts those
requests in the engine (their KV blocks are freed; the client gets a CANCELLED error with the
final flag); a metrics thread refreshes the gauges.

Inputs (dims ``[1]`` after the batch dimension; one request per batch): ``text_input`` and
``max_tokens`` required; ``stream``, ``temperature``, ``top_p``, ``top_k``, ``random_seed`` /
``seed``, ``min_length`` / ``min_tokens``, ``end_id``, ``pad_id``, ``stop_words``, ``bad_words``,
``exclude_input_in_output``, ``return_num_input_tokens``, ``return_num_output_tokens``,
``return_perf_metrics``, ``return_log_probs``, ``num_draft_tokens`` optional. Outputs:
``text_output`` (a streamed response carries the new text), ``num_input_tokens``,
``num_output_tokens`` (tokens in this response), ``finish_reason``, ``acceptance_rate``,
``total_accepted_draft_tokens``, ``total_draft_tokens``.

Metrics (Triton's custom-metrics API, on its metrics port): vLLM's names
(:mod:`dflash_trt.serving.metrics`), without the ``_total`` suffix that Triton does not add;
``vllm:request_success`` counts every request by ``finished_reason`` (``stop``, ``length``,
``abort`` for a cancelled one, ``error`` for one the engine failed on).

A request that makes an engine iteration fail gets an error response; the requests batched with
it complete as if it had not been there (``runtime/engine.py``, failed iterations).
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np

try:  # present inside Triton's python-backend stub only
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported outside Triton for documentation / tests
    pb_utils = None

INPUTS = [  # name, Triton type, dims after the batch dimension, optional
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], False),
    ("stream", "TYPE_BOOL", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("random_seed", "TYPE_UINT64", [1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("min_length", "TYPE_INT32", [1], True),
    ("min_tokens", "TYPE_INT32", [1], True),
    ("end_id", "TYPE_INT32", [1], True),
    ("pad_id", "TYPE_INT32", [1], True),
    ("stop_words", "TYPE_STRING", [-1], True),
    ("bad_words", "TYPE_STRING", [-1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
    ("return_perf_metrics", "TYPE_BOOL", [1], True),
    ("return_log_probs", "TYPE_BOOL", [1], True),
    ("num_draft_tokens", "TYPE_INT32", [1], True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_INT32", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
]


def _scalar(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise ValueError(f"input {name} must hold one value per request, got shape {list(a.shape)}")
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item()


def _strings(request, name: str) -> list[str]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    out = []
    for v in t.as_numpy().reshape(-1):
        s = v.decode("utf-8") if isinstance(v, bytes) else str(v)
        out += [x for x in s.split(",") if x] if name.endswith("_words") else [s]
    return out


class _Live:
    """A request in flight: its sender, what it has sent, its counters."""

    def __init__(self, sender, stream: bool, detok, prompt: str, prompt_tokens: int, include_input: bool):
        self.sender, self.stream, self.detok = sender, stream, detok
        self.prompt, self.prompt_tokens, self.include_input = prompt, prompt_tokens, include_input
        self.sent_tokens = 0
        self.done = False
        self.lock = threading.Lock()


class TritonPythonModel:
    """The ``dflash`` model (see the module docstring)."""

    def initialize(self, args):
        from dflash_trt.serving.service import EngineService, ServeConfig

        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        if not pb_utils.using_decoupled_model_transaction_policy(cfg):
            raise pb_utils.TritonModelException("the dflash model needs model_transaction_policy { decoupled: true }")
        self.service = EngineService(ServeConfig.from_json(params.get("dflash_config", "{}")))
        self.period = int(params.get("cancellation_check_period_ms", "100")) / 1000.0
        self.live: dict[int, _Live] = {}
        self.next_id = 0
        self.lock = threading.Lock()
        self.running = True
        self._metrics(args["model_name"])
        self.service.engine.add_finish_listener(self._count)
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._cancellation_loop, self._metrics_loop)]
        for t in self.threads:
            t.start()

    # ---- requests ----
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._enqueue(request, sender)
            except Exception as e:  # a bad request: one error response, the model keeps serving
                msg = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(msg.splitlines()[0])),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        return None

    def _enqueue(self, request, sender) -> None:
        from dflash_trt.errors import DFlashError
        from dflash_trt.runtime.sampling import SamplingParams
        from dflash_trt.serving.detokenizer import IncrementalDetokenizer

        text = _scalar(request, "text_input")
        if not isinstance(text, str) or not text:
            raise ValueError("text_input must be a non-empty string")
        max_tokens = _scalar(request, "max_tokens")
        if _strings(request, "bad_words"):
            raise ValueError("bad_words are not supported")
        seed = _scalar(request, "seed")
        seed = _scalar(request, "random_seed") if seed is None else seed
        min_tokens = _scalar(request, "min_tokens")
        min_tokens = _scalar(request, "min_length") if min_tokens is None else min_tokens
        end_id = _scalar(request, "end_id")
        svc = self.service
        ids = svc.tokenizer.encode(text)
        temperature, top_p, top_k = (_scalar(request, n) for n in ("temperature", "top_p", "top_k"))
        try:
            sampling = SamplingParams(
                float(temperature or 0.0),
                float(1.0 if top_p is None else top_p),
                int(top_k or 0),
                None if seed is None else int(seed),
            )
            req = svc.request(
                ids,
                int(max_tokens) if max_tokens is not None else 0,
                sampling,
                max_draft_tokens=_scalar(request, "num_draft_tokens"),
                min_tokens=int(min_tokens or 0),
                end_id=None if end_id is None else int(end_id),
            )
        except DFlashError as e:
            raise ValueError(str(e)) from None
        stream = bool(_scalar(request, "stream"))
        include = not stream and not bool(_scalar(request, "exclude_input_in_output"))
        live = _Live(
            sender,
            stream,
            IncrementalDetokenizer(svc.tokenizer, _strings(request, "stop_words")),
            text,
            len(ids),
            include,
        )
        with self.lock:  # registered before the engine can call back
            sid = self.next_id
            self.next_id += 1
            self.live[sid] = live
        try:
            svc.llm.submit(req, on_tokens=self._on_tokens, on_finish=self._on_finish, seq_id=sid)
        except Exception:
            with self.lock:
                self.live.pop(sid, None)
            raise

    # ---- engine callbacks (on the engine thread) ----
    def _on_tokens(self, sid: int, tokens: list[int]) -> None:
        live = self.live.get(sid)
        if live is None or live.done:
            return
        text = live.detok.push(tokens)
        live.sent_tokens += len(tokens) if live.stream else 0
        if live.detok.stopped:
            self.service.engine.abort(sid, "stop")  # a stop word: end here (KV freed), reported as "stop"
        if live.stream and text:
            live.sender.send(self._response(live, text, len(tokens), None, None))

    def _on_finish(self, sid: int, out) -> None:
        from dflash_trt.serving.service import ENGINE_FAILED

        with self.lock:
            live = self.live.pop(sid, None)
        if live is None:
            return
        live.done = True
        self._counter(self.m_success, "finished_reason", "stop" if live.detok.stopped else out.finish_reason)
        if out.finish_reason in ("abort", "error") and not live.detok.stopped:  # cancelled, or the engine failed
            err = (
                pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                if out.finish_reason == "abort"
                else pb_utils.TritonError(ENGINE_FAILED)
            )
            live.sender.send(pb_utils.InferenceResponse(error=err), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        tail = live.detok.finish()
        reason = "stop" if live.detok.stopped else out.finish_reason
        if live.stream:
            text, n = tail, len(out.output_ids) - live.sent_tokens
        else:
            text, n = (live.prompt if live.include_input else "") + live.detok.text, len(out.output_ids)
        live.sender.send(
            self._response(live, text, n, reason, out), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def _response(self, live: _Live, text: str, n_tokens: int, reason: str | None, out):
        drafts = accepted = 0
        if out is not None:
            _, drafts, accepted, _ = out.spec_counts
        tensors = [
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([[live.prompt_tokens]], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([[n_tokens]], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([[(reason or "").encode()]], dtype=np.object_)),
            pb_utils.Tensor("acceptance_rate", np.array([[accepted / drafts if drafts else 0.0]], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([[accepted]], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([[drafts]], dtype=np.int32)),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # ---- threads ----
    def _cancellation_loop(self) -> None:
        while self.running:
            time.sleep(self.period)
            with self.lock:
                gone = [sid for sid, live in self.live.items() if live.sender.is_cancelled()]
            for sid in gone:
                self.service.engine.abort(sid)

    def _metrics(self, model_name: str) -> None:
        fam = pb_utils.MetricFamily
        lbl = {"model_name": model_name}

        self.families = []  # a MetricFamily must outlive its Metrics

        def metric(name, doc, kind, **extra):
            self.families.append(fam(name=name, description=doc, kind=kind))
            return self.families[-1].Metric(labels={**lbl, **extra})

        self.m_running = metric("vllm:num_requests_running", "Requests in the running batch.", fam.GAUGE)
        self.m_waiting = metric("vllm:num_requests_waiting", "Requests waiting for admission.", fam.GAUGE)
        self.m_kv = metric("vllm:kv_cache_usage_perc", "Share of KV-cache blocks in use.", fam.GAUGE)
        self.m_prompt = metric("vllm:prompt_tokens", "Prefill tokens processed.", fam.COUNTER)
        self.m_gen = metric("vllm:generation_tokens", "Tokens generated.", fam.COUNTER)
        self.m_drafts = metric("vllm:spec_decode_num_drafts", "Verify steps that checked drafts.", fam.COUNTER)
        self.m_draft_tokens = metric("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", fam.COUNTER)
        self.m_accepted = metric("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", fam.COUNTER)
        self.m_cache_queries = metric(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", fam.COUNTER
        )
        self.m_cache_hits = metric("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", fam.COUNTER)
        self.cache_counted = (0, 0)  # the block manager's counts already added to the two above
        self.labels = lbl

        def labelled(name, doc):  # a counter family whose series (per label value) appear when first counted
            self.families.append(fam(name=name, description=doc, kind=fam.COUNTER))
            return self.families[-1], {}

        self.m_per_pos = labelled(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per draft position."
        )
        self.m_success = labelled("vllm:request_success", "Requests finished, by finish reason.")

    def _counter(self, family_and_series, label: str, value, n: int = 1) -> None:
        """Add ``n`` to the series of a :meth:`_metrics` ``labelled`` family with ``label=value``."""
        family, series = family_and_series
        if value not in series:
            series[value] = family.Metric(labels={**self.labels, label: str(value)})
        series[value].increment(n)

    def _count(self, out, prompt_tokens: int) -> None:
        self.m_prompt.increment(prompt_tokens)
        self.m_gen.increment(len(out.output_ids))
        drafts, draft_tokens, accepted, per_pos = out.spec_counts
        self.m_drafts.increment(drafts)
        self.m_draft_tokens.increment(draft_tokens)
        self.m_accepted.increment(accepted)
        for i, n in enumerate(per_pos):
            self._counter(self.m_per_pos, "position", i, n)

    def _metrics_loop(self) -> None:
        e = self.service.engine
        while self.running:
            self.m_running.set(len(e.scheduler.running))
            self.m_waiting.set(e.num_waiting())
            self.m_kv.set(1.0 - e.blocks.num_free_blocks / e.blocks.num_blocks)
            queries, hits = e.blocks.prefix_queries, e.blocks.prefix_hits
            self.m_cache_queries.increment(queries - self.cache_counted[0])
            self.m_cache_hits.increment(hits - self.cache_counted[1])
            self.cache_counted = (queries, hits)
            time.sleep(0.1)

    def finalize(self):
        self.running = False
        for t in self.threads:
            t.join(1.0)
        self.service.close()
