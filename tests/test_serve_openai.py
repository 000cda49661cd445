"""The OpenAI-compatible server on the real SmolLM2 target and real prompts, through the
official ``openai`` client and raw HTTP (httpx), on 127.0.0.1:

* completions and chat, streaming and not, give the same text as plain decoding of the same
  prompt (greedy; the server runs DFlash with the adaptive draft length) and the right usage;
* 32 concurrent streams are all right; a client that disconnects mid-stream frees its KV
  blocks and the server keeps serving; a 200-request soak with random lengths and
  cancellations loses and duplicates nothing and ends with every KV block free;
* bad requests get a 4xx with ``{"error": {...}}`` and the server keeps serving; sent beside good
  requests, the good ones still get plain decoding's answers;
* 16 and 32 concurrent streams get their tokens as the engine makes them (no burst); 16 clients
  that leave mid-stream are aborted within a second (the abort counter up by 16);
* ``--api-key`` (401 / 200), the body size limit (413) and the waiting-queue bound (503);
* requests that make the engine fail (a fault injected into its runner) get a 500 (streamed: an
  error event) and the requests batched with them plain decoding's answers;
* the ``/metrics`` spec-decode counters equal the engine's own counts;
* ``dflash-trt serve`` starts from the command line and answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from helpers import (
    CLI,
    TLS,
    burst_share,
    error_line,
    free_ports,
    plain_outputs,
    run,
    same_text,
    saved_drafter,
    serving_args,
)

from dflash_trt.prompts import chat_prompt_ids, mixed_prompts

openai = pytest.importorskip("openai", reason="pip install openai")
MAX_NEW = 24


def wait_health(port: int, proc: subprocess.Popen, tries: int = 600) -> None:
    """Until ``GET /health`` answers 200 (fails early if the server process died)."""
    for _ in range(tries):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, verify=TLS).status_code == 200:
                return
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
    raise AssertionError("the server never became healthy")


@pytest.fixture(scope="module")
def server(random_drafter, tmp_path_factory):
    """An in-process uvicorn server (so the test sees the engine) on a free port."""
    import torch
    import uvicorn

    from dflash_trt.serving.openai_api import build_app
    from dflash_trt.serving.service import EngineService, ServeConfig

    service = EngineService(ServeConfig(serving_args(random_drafter, tmp_path_factory.mktemp("d"), max_batch_size=32)))
    (port,) = free_ports(1)
    srv = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    torch.set_num_threads(1)
    yield service, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(10)
    service.close()


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(8)


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    """Plain decoding (block size 1) of each prompt as chat and as raw text, the prompts in one
    batch (the comparisons here allow ties)."""
    tok = smollm2.tokenizer
    chat = [chat_prompt_ids(tok, p) for p in prompts]
    raw = [tok.encode(p) for p in prompts]
    return {
        "chat": list(zip(chat, plain_outputs(smollm2, chat, MAX_NEW, batched=True))),
        "raw": list(zip(raw, plain_outputs(smollm2, raw, MAX_NEW, batched=True))),
    }


def test_completions_and_chat_equal_plain_decoding(server, smollm2, prompts, reference):
    """Every prompt as a completion and as a chat, each streamed and not: 32 requests at once
    (through the official client, one thread each), every answer plain decoding's."""
    from concurrent.futures import ThreadPoolExecutor

    _, url = server
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    model = c.models.list().data[0].id

    def completion(p, ids, ref):
        r = c.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
        assert same_text(smollm2, ids, ref, r.choices[0].text)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
        assert r.choices[0].finish_reason == ("length" if len(ref) == MAX_NEW and ref[-1] not in (1, 2) else "stop")

    def completion_stream(p, ids, ref):
        stream = c.completions.create(
            model=model,
            prompt=p,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)
        assert same_text(smollm2, ids, ref, "".join(ch.choices[0].text for ch in chunks if ch.choices))

    def chat(p, ids, ref):
        msgs = [{"role": "user", "content": p}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=MAX_NEW, temperature=0)
        assert same_text(smollm2, ids, ref, r.choices[0].message.content)
        assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + len(ref)

    def chat_stream(p, ids, ref):
        stream = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": p}],
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert same_text(smollm2, ids, ref, text)
        assert chunks[-1].usage.completion_tokens == len(ref) and chunks[1].usage is not None

    jobs = [(f, p, *r) for f in (completion, completion_stream) for p, r in zip(prompts, reference["raw"])]
    jobs += [(f, p, *r) for f in (chat, chat_stream) for p, r in zip(prompts, reference["chat"])]
    with ThreadPoolExecutor(len(jobs)) as ex:
        for fut in [ex.submit(*job) for job in jobs]:
            fut.result()  # (an assertion of any request fails the test here)


def _chat_body(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    """A greedy chat request of one user message."""
    messages = [{"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


async def _stream_chat(url: str, model: str, prompt: str, max_tokens: int, stop_after: int | None = None):
    """Stream one chat answer with raw httpx; leave after ``stop_after`` chunks (a client that
    goes away). Returns the text and whether it reached ``[DONE]``."""
    body = _chat_body(model, prompt, max_tokens, stream=True)
    parts, n = [], 0
    async with (
        httpx.AsyncClient(timeout=600, verify=TLS) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(parts), True
            ch = json.loads(line[6:])
            parts.append(ch["choices"][0]["delta"].get("content") or "")
            n += 1
            if stop_after is not None and n >= stop_after:
                return "".join(parts), False
    return "".join(parts), False


def _wait_idle(service, timeout=60.0):
    end = time.time() + timeout
    while time.time() < end:
        e = service.engine
        if not e.has_unfinished() and e.blocks.num_free_blocks == e.blocks.num_blocks:
            return True
        time.sleep(0.1)
    return False


def test_concurrent_streams_disconnects_and_soak(server, smollm2, prompts, reference):
    service, url = server
    model = service.model_name
    refs = reference["chat"]

    async def many():
        jobs = [_stream_chat(url, model, prompts[i % 8], MAX_NEW) for i in range(32)]
        jobs.append(_stream_chat(url, model, prompts[0], MAX_NEW, stop_after=3))  # leaves mid-stream
        return await asyncio.gather(*jobs)

    got = asyncio.run(many())
    for i, (text, done) in enumerate(got[:32]):
        ids, ref = refs[i % 8]
        assert done and same_text(smollm2, ids, ref, text), i
    assert not got[32][1]
    assert _wait_idle(service), "the disconnected client's request still holds KV blocks"

    # soak: 200 requests, random lengths, a random third of the clients leave early
    rng = random.Random(7)
    plan = [(rng.randrange(8), rng.randint(1, MAX_NEW), rng.random() < 0.33) for _ in range(200)]

    async def soak():
        sem = asyncio.Semaphore(24)

        async def one(i, n, leave):
            async with sem:
                return await _stream_chat(url, model, prompts[i], n, stop_after=rng.randint(1, 4) if leave else None)

        return await asyncio.gather(*(one(*p) for p in plan))

    results = asyncio.run(soak())
    tok = smollm2.tokenizer
    for (i, n, leave), (text, done) in zip(plan, results):
        ids, ref = refs[i]
        if done:  # a prefix of the full answer: exactly the first n tokens
            assert same_text(smollm2, ids, ref[:n], text) or tok.decode(ref[:n], skip_special_tokens=True) == text
        else:
            assert leave
    assert _wait_idle(service), "KV blocks leaked after the soak"
    # the server still answers
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompts[1]}], max_tokens=5, temperature=0
    )
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "five"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-5"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n = 2"),
        ("/v1/completions", {"prompt": "word " * 9000, "max_tokens": 5}, 400, "limit"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ],
)
def test_bad_requests_get_4xx(server, path, body, status, needle):
    _, url = server
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param"), err
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]


def test_malformed_json_and_unknown_fields(server):
    _, url = server
    r = httpx.post(url + "/v1/completions", content=b"{bad json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "frobnicate": True, "user": "me"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_metrics_equal_engine_counts(server):
    service, url = server
    assert _wait_idle(service)
    text = httpx.get(url + "/metrics").text

    def value(name, **labels):
        return _metric(url, name, **labels)

    st = service.engine.stats
    assert value("vllm:spec_decode_num_drafts_total") == st.drafting_steps > 0
    assert value("vllm:spec_decode_num_draft_tokens_total") == st.draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total") == sum(st.accepted)
    for i, a in enumerate(st.accepted):
        assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) == a
    assert value("vllm:num_requests_running") == 0 and value("vllm:kv_cache_usage_perc") == 0
    assert value("vllm:generation_tokens_total") >= st.committed > 0
    assert "vllm:time_to_first_token_seconds_bucket" in text
    # the earlier tests sent the same prompts many times: most of their blocks came from the prefix cache
    bm = service.engine.blocks
    assert value("vllm:prefix_cache_queries_total") == bm.prefix_queries > 0
    assert value("vllm:prefix_cache_hits_total") == bm.prefix_hits > 0


def test_stop_string_ends_as_stop(server, smollm2, prompts, reference):
    """A stop string found in the answer ends the request there with finish reason "stop"
    (the text cut before the stop string), counted as a stop in ``vllm:request_success_total``."""
    service, url = server
    ids, ref = reference["raw"][0]
    full = smollm2.tokenizer.decode(ref, skip_special_tokens=True)
    words = full.split()
    assert len(words) >= 4, full
    stop = words[len(words) // 2]
    stops = _metric(url, "vllm:request_success_total", finished_reason="stop")
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = c.completions.create(
        model=service.model_name, prompt=prompts[0], max_tokens=MAX_NEW, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    assert _wait_idle(service)
    assert _metric(url, "vllm:request_success_total", finished_reason="stop") == stops + 1


def test_serve_command(tmp_path):
    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        CLI + ["serve", "--port", str(port), "--block-size", "1", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_health(port, proc)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "One, two,", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the port is taken now: a second server says so in one line
        assert "cannot listen" in error_line(run("serve", "--port", str(port)))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_serve_tp2_equals_tp1(smollm2, random_drafter, prompts, reference, tmp_path):
    """``mpiexec -n 2 dflash-trt serve``: the target tensor-parallel over two ranks, DFlash
    drafting replicated; 8 concurrent chat requests give plain decoding's (TP=1) text."""
    import shutil
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    local = Path(sys.executable).parent / "mpiexec"  # the mpich wheel's, in the venv
    mpiexec = str(local) if local.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich mpi4py)")
    drafter_dir = saved_drafter(random_drafter, tmp_path)
    (port,) = free_ports(1)
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dflash_trt.cli", "serve", "--port", str(port)]
    cmd += ["--drafter", str(drafter_dir), "--block-size", "4", "--threads", "1", "--dtype", "fp32"]
    cmd += ["--max-batch-size", "8"]  # (the adaptive controller's start-up calibration stops there)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    try:
        wait_health(port, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id

        def ask(text):
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=MAX_NEW, temperature=0
            )
            return r.choices[0].message.content

        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(ask, prompts))
        assert all(same_text(smollm2, ids, ref, g) for (ids, ref), g in zip(reference["chat"], got))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert re.search(r"vllm:spec_decode_num_drafts_total\{[^}]*\} [1-9]", metrics)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = rf"^{re.escape(name)}\{{[^}}]*{re.escape(sel)}[^}}]*\}} (\S+)$"
    return sum(float(m) for m in re.findall(pat, text, re.M))


@pytest.fixture(scope="module")
def keyed_server(server):
    """A second HTTP front door on the same engine, with an API key."""
    import uvicorn

    from dflash_trt.serving.openai_api import build_app

    service, _ = server
    (port,) = free_ports(1)
    srv = uvicorn.Server(
        uvicorn.Config(build_app(service, api_key="sk-test", max_request_bytes=1 << 20), port=port, log_level="warning")
    )
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(10)


def test_api_key_and_body_limit(keyed_server):
    url = keyed_server
    body = {"prompt": "One, two,", "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"}, timeout=60)
    assert r.status_code == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test")  # the official client sends the Bearer header
    assert c.completions.create(model=c.models.list().data[0].id, **body).usage.completion_tokens == 2
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    # a body over the limit: 413, by its Content-Length and chunked alike
    big = {"prompt": "word " * 300_000, "max_tokens": 1}
    auth = {"Authorization": "Bearer sk-test"}
    r = httpx.post(url + "/v1/completions", json=big, headers=auth, timeout=60)
    assert r.status_code == 413, r.text

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    r = httpx.post(url + "/v1/completions", content=chunks(), headers=auth, timeout=60)
    assert r.status_code == 413, r.text


def test_waiting_queue_bound(server):
    service, url = server
    body = {"prompt": "One, two,", "max_tokens": 2, "temperature": 0}
    old = service.max_waiting_requests
    service.max_waiting_requests = 0  # no room: every new request is refused
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "max_waiting_requests" in r.json()["error"]["message"]
    finally:
        service.max_waiting_requests = old
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": [1, 2, 3, 99999999], "max_tokens": 4}, "vocabulary"),
    ("/v1/completions", {"prompt": [1, 2, -5], "max_tokens": 4}, "vocabulary"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1}, "penalty"),
]
# JSON that parses to a string Python cannot encode (a lone surrogate escape)
SURROGATES = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": "x\\udfff", "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 4}'),
]


def test_bad_requests_beside_good_ones(server, smollm2, prompts, reference, caplog):
    """Bad requests sent together with good ones: each bad one a 4xx with a one-line message
    and no traceback in the log, each good one plain decoding's answer (the bad ones never
    reach the engine)."""
    service, url = server
    model = service.model_name
    refs = reference["chat"]

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:

            async def good(i):
                return await client.post("/v1/chat/completions", json=_chat_body(model, prompts[i], MAX_NEW))

            jobs = [good(i) for i in range(4)]
            jobs += [client.post(path, json=body) for path, body, _ in BAD_REQUESTS]
            jobs += [
                client.post(path, content=raw, headers={"content-type": "application/json"}) for path, raw in SURROGATES
            ]
            return await asyncio.gather(*jobs)

    with caplog.at_level("WARNING"):
        got = asyncio.run(go())
    for i, r in enumerate(got[:4]):
        ids, ref = refs[i]
        assert r.status_code == 200 and same_text(smollm2, ids, ref, r.json()["choices"][0]["message"]["content"]), i
    needles = [n for _, _, n in BAD_REQUESTS] + ["messages", "prompt", "stop"]
    for r, needle in zip(got[4:], needles):
        assert r.status_code == 400, (needle, r.text)
        err = r.json()["error"]
        assert needle in err["message"] or needle in (err.get("param") or ""), err
        assert "\n" not in err["message"]
    assert not [rec for rec in caplog.records if rec.exc_info], "a bad request logged a traceback"
    assert _wait_idle(service)


async def _timed_stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, leave_after=None):
    """Stream one chat answer (``ignore_eos``: exactly ``max_tokens`` tokens); returns the
    arrival time (``time.perf_counter()``) of every chunk with content. Leaves after
    ``leave_after`` such chunks (a client that goes away)."""
    body = _chat_body(model, prompt, max_tokens, ignore_eos=True, stream=True)
    times = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
            if choices and choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
                if leave_after is not None and len(times) >= leave_after:
                    break
    return times


@pytest.mark.parametrize("streams", [16, 32])
def test_streams_arrive_as_the_engine_makes_them(server, prompts, streams):
    """Many concurrent streams: every stream's tokens arrive spread over its engine iterations,
    never held back and delivered in one burst (the event loop used to wait for whole engine
    iterations to queue a request or an abort)."""
    service, url = server
    engine = service.engine
    engine.iteration_s.clear()

    async def go():
        limits = httpx.Limits(max_connections=streams)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            jobs = [_timed_stream(client, service.model_name, prompts[i % 8], 20) for i in range(streams)]
            return await asyncio.gather(*jobs)

    got = asyncio.run(go())
    iters = sorted(engine.iteration_s)
    p50, longest = iters[len(iters) // 2], iters[-1]
    shares = [burst_share(ts, p50 / 2) for ts in got]
    gaps = [b - a for ts in got for a, b in zip(ts, ts[1:])]
    print(
        f"\n{streams} streams: {len(iters)} iterations (p50 {p50 * 1e3:.0f} ms, longest {longest * 1e3:.0f} ms: "
        f"the prompts' prefill); chunks per stream {min(map(len, got))}-{max(map(len, got))}; "
        f"largest burst share {max(shares):.2f}; gap between chunks max {max(gaps) * 1e3:.0f} ms"
    )
    assert all(len(ts) >= 8 for ts in got)
    assert max(shares) <= 0.5, shares  # (it was 1.0 for most streams when the event loop waited for the engine)
    assert max(gaps) <= longest + 2 * p50 + 0.05  # a stream waits at most about one iteration for its next token
    assert _wait_idle(service)


def test_sixteen_disconnects_abort_at_once(server, prompts):
    """16 streams leave after 3 chunks: within 1 s (plus three of the longest iterations seen, on a
    loaded machine) nothing runs, every KV block is free, and the abort counter is up by 16."""
    service, url = server
    service.engine.iteration_s.clear()
    aborted = _metric(url, "vllm:request_success_total", finished_reason="abort")

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=16)) as client:
            jobs = [_timed_stream(client, service.model_name, prompts[i % 8], 256, leave_after=3) for i in range(16)]
            return await asyncio.gather(*jobs)

    asyncio.run(go())
    left = time.perf_counter()
    bound = 1.0 + 3 * max(service.engine.iteration_s, default=0.0)
    assert _wait_idle(service, timeout=bound), f"aborted requests still run or hold KV blocks {bound:.1f} s later"
    print(f"\n16 disconnects: idle {time.perf_counter() - left:.3f} s after the last client left")
    assert _metric(url, "vllm:num_requests_running") == 0
    assert _metric(url, "vllm:request_success_total", finished_reason="abort") == aborted + 16


def test_engine_failure_fails_only_its_request(server, smollm2, prompts, reference, caplog):
    """Two requests that make every engine iteration holding them fail (a fault injected into the
    runner: one in its prompt's prefill, the other once it has 3 tokens), sent beside 4 good ones
    (2 streamed): the first gets HTTP 500 with an OpenAI error body, the second its first tokens,
    an error event and ``[DONE]``; every good one plain decoding's answer; the error counter up
    by 2, one traceback logged per failed request, and the engine idle after."""
    service, url = server
    engine, tok, model, refs = service.engine, service.tokenizer, service.model_name, reference["chat"]
    errors = _metric(url, "vllm:request_success_total", finished_reason="error")
    add, step = engine.add_request, engine.runner.step
    lock, culprits = threading.Lock(), {}  # sequence id -> (prompt length, "prefill" | "decode")

    def add_request(request, *args, **kwargs):
        with lock:  # registered before the engine's runner can see it
            sid = add(request, *args, **kwargs)
            text = tok.decode(request.prompt_ids)
            if "FAULT-INJECTED" in text:
                culprits[sid] = (len(request.prompt_ids), "decode" if "decode" in text else "prefill")
            return sid

    def faulty_step(plan):
        with lock:
            for it in plan.items:
                n, when = culprits.get(it.seq_id, (0, None))
                if (when == "prefill" and it.start < n) or (when == "decode" and it.start >= n + 3):
                    raise RuntimeError(f"injected fault: sequence {it.seq_id}")
        return step(plan)

    async def streamed(client, body):
        events = []
        async with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
        return events

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            good = [_chat_body(model, prompts[i], MAX_NEW) for i in range(4)]
            return await asyncio.gather(
                client.post("/v1/chat/completions", json=good[0]),
                client.post("/v1/chat/completions", json=good[1]),
                streamed(client, good[2]),
                streamed(client, good[3]),
                client.post("/v1/chat/completions", json=_chat_body(model, "FAULT-INJECTED. " + prompts[4], MAX_NEW)),
                streamed(client, _chat_body(model, "FAULT-INJECTED decode. " + prompts[5], MAX_NEW)),
            )

    engine.add_request, engine.runner.step = add_request, faulty_step
    try:
        with caplog.at_level("WARNING"):
            ok0, ok1, ok2, ok3, bad, bad_stream = asyncio.run(go())
    finally:
        del engine.add_request, engine.runner.step
    for i, r in enumerate([ok0, ok1]):
        ids, ref = refs[i]
        assert r.status_code == 200 and same_text(smollm2, ids, ref, r.json()["choices"][0]["message"]["content"]), i
    for i, events in [(2, ok2), (3, ok3)]:
        ids, ref = refs[i]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        assert (
            events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] and same_text(smollm2, ids, ref, text)
        )
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "InternalServerError", bad.text
    assert "engine failed" in bad.json()["error"]["message"]
    assert bad_stream[-1] == "[DONE]" and bad_stream[-2]["error"]["code"] == 500, bad_stream[-3:]
    assert sum(bool(e["choices"][0]["delta"].get("content")) for e in bad_stream[1:-2]) >= 1  # tokens before it failed
    assert not any(e["choices"][0]["finish_reason"] for e in bad_stream[:-2])
    assert _wait_idle(service)
    assert _metric(url, "vllm:request_success_total", finished_reason="error") == errors + 2
    traced = [rec.getMessage() for rec in caplog.records if rec.exc_info]
    assert len(traced) == 2 and all("alone" in m for m in traced), traced
