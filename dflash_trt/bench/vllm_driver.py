"""vLLM's offline engine behind a pipe: the child process of :class:`~.vllm_peer.VllmSession`.

Runs under the vLLM environment's interpreter (``make peers``: ``.venv-vllm``), which does not
have dflash_trt installed, so this file imports only the standard library and vLLM. Protocol:
one JSON object per line on stdin, one answer per line on the original stdout (vLLM's own logs
are sent to stderr):

1. ``{"model", "dtype", "speculative", "max_num_seqs", "max_model_len", "enforce_eager"}`` ->
   ``{"ready": true, "version", "load_s"}`` or ``{"error": "..."}``;
2. then any number of ``{"prompts": [[ids]], "max_new_tokens", "stop_token_ids", "concurrency"}``
   -> ``{"outputs": [[ids]], "wall_s", "drafts", "accepted"}`` (greedy, through vLLM's
   ``LLMEngine`` with at most ``concurrency`` requests in flight; ``wall_s``: from the first
   request added to the last one finished; ``drafts`` / ``accepted``: vLLM's spec-decode
   counters over the call);
3. EOF ends it.
"""

import json
import os
import sys
import time


def _counters(llm) -> tuple[int, int]:
    """vLLM's ``spec_decode_num_drafts`` and ``spec_decode_num_accepted_tokens`` so far (0, 0
    without speculative decoding)."""
    got = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return int(got.get("vllm:spec_decode_num_drafts", 0)), int(got.get("vllm:spec_decode_num_accepted_tokens", 0))


def _closed_loop(engine, prompts: list[list[int]], sp, concurrency: int) -> list[list[int]]:
    """Serve ``prompts`` through vLLM's ``LLMEngine`` with at most ``concurrency`` in flight (a
    finished request's slot takes the next prompt at once); new token ids per prompt."""
    outputs: list = [None] * len(prompts)
    index: dict[str, int] = {}
    nxt = live = 0
    while nxt < len(prompts) or live:
        while nxt < len(prompts) and live < concurrency:
            rid = engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, sp)
            index[rid] = index[str(nxt)] = nxt
            nxt, live = nxt + 1, live + 1
        for out in engine.step():
            if out.finished:
                outputs[index[out.request_id]] = list(out.outputs[0].token_ids)
                live -= 1
    return outputs


def main() -> None:
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM (and its engine process, which inherits fd 1) logs to stderr
    cfg = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=cfg["model"],
            dtype=cfg["dtype"],
            max_model_len=cfg["max_model_len"],
            max_num_seqs=cfg["max_num_seqs"],
            speculative_config=cfg["speculative"],
            enforce_eager=cfg.get("enforce_eager", False),
            disable_log_stats=False,
            seed=0,
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        answer.write(json.dumps({"error": f"{type(e).__name__}: {e}".splitlines()[0]}) + "\n")
        return
    answer.write(json.dumps({"ready": True, "version": vllm.__version__, "load_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["stop_token_ids"])
        d0, a0 = _counters(llm)
        t = time.perf_counter()
        outputs = _closed_loop(llm.llm_engine, job["prompts"], sp, job["concurrency"])
        wall = time.perf_counter() - t
        d1, a1 = _counters(llm)
        answer.write(json.dumps({"outputs": outputs, "wall_s": wall, "drafts": d1 - d0, "accepted": a1 - a0}) + "\n")


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main()
