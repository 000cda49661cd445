"""Prometheus metrics with vLLM's names (``vllm/v1/metrics/loggers.py``), so dashboards and load
testers built for vLLM read dflash-trt unchanged (../shared/SERVING.md "Metrics").

Gauges are read from the engine when scraped; counters and histograms are fed per request when
it finishes. Counters get ``_total`` appended by ``prometheus_client``. Every series carries the
label ``model_name``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..runtime.request import RequestResult

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


disable_created_metrics()  # no ``*_created`` series (vLLM's exposition has none)


class _PrefixCacheCounters:
    """``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (prompt tokens looked up in the
    prefix cache, and those found), read from the block manager when scraped."""

    def __init__(self, blocks, model_name: str):
        self.blocks, self.model_name = blocks, model_name

    def collect(self):
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", self.blocks.prefix_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", self.blocks.prefix_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c


class ServingMetrics:
    """The metrics of one served model.

    Args:
        model_name: the ``model_name`` label.
        engine: the :class:`~dflash_trt.runtime.engine.LLMEngine` whose queue and KV usage the
            gauges report.
    """

    def __init__(self, model_name: str, engine):
        self.registry = CollectorRegistry()
        lbl = {"model_name": model_name}
        self.model_name = model_name
        sched, blocks = engine.scheduler, engine.blocks

        def gauge(name: str, doc: str, fn) -> None:
            g = Gauge(name, doc, ["model_name"], registry=self.registry)
            g.labels(**lbl).set_function(fn)

        gauge("vllm:num_requests_running", "Requests in the running batch.", lambda: len(sched.running))
        gauge("vllm:num_requests_waiting", "Requests waiting for admission.", engine.num_waiting)
        gauge(
            "vllm:kv_cache_usage_perc",
            "Share of KV-cache blocks in use (1 = full).",
            lambda: 1.0 - blocks.num_free_blocks / blocks.num_blocks,
        )

        self.registry.register(_PrefixCacheCounters(blocks, model_name))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()):
            return Counter(name, doc, ["model_name", *labels], registry=self.registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(**lbl)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(**lbl)
        self.request_success = counter("vllm:request_success", "Requests finished.", ("finished_reason",))
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Verify steps that checked drafts.").labels(**lbl)
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.").labels(**lbl)
        self.num_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**lbl)
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per draft position.", ("position",)
        )

        def hist(name: str, doc: str):
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**lbl)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to the first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens (per request mean).")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.")

    def observe(self, out: RequestResult, prompt_tokens: int) -> None:
        """Count a finished request (aborted ones too: their tokens were computed)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(out.output_ids))
        reason = "abort" if out.finish_reason == "abort" else out.finish_reason
        self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        drafts, draft_tokens, accepted, per_pos = out.spec_counts
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(draft_tokens)
        self.num_accepted.inc(accepted)
        for i, n in enumerate(per_pos):
            self.accepted_per_pos.labels(model_name=self.model_name, position=str(i)).inc(n)
        if out.output_ids:
            self.ttft.observe(out.ttft_s)
            self.e2e.observe(out.latency_s)
            if len(out.output_ids) > 1:
                self.itl.observe((out.latency_s - out.ttft_s) / (len(out.output_ids) - 1))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
