"""``AsyncLLM``: an :class:`~.engine.LLMEngine` stepped on a background thread, with requests
streamed to asyncio callers (the OpenAI server and the Triton model drive it)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from .engine import LLMEngine
from .request import Request, RequestResult
from .sequence import TokenCallback

log = logging.getLogger("dflash_trt.runtime")


class StopStream(Exception):
    """Thrown into :meth:`AsyncLLM.stream` to end its request as stopped (``finish_reason``
    ``stop``), not aborted."""


class AsyncLLM:
    """Streams requests through an :class:`LLMEngine` stepped on a background thread.

    ``async for tokens in llm.generate(request)`` yields each batch of committed tokens (one
    list per verify step); leaving the loop early (``break``, task cancellation) aborts the
    request. ``close()`` stops the thread. A failed iteration ends only the request that makes
    it fail (:attr:`LLMEngine.isolate_failures` is turned on); a failure the engine cannot
    attribute to a request ends every request in flight (:meth:`LLMEngine.fail_all`).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.isolate_failures = True
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if self.engine.has_unfinished():
                try:
                    self.engine.step()
                except Exception:  # not attributable to one request: keep serving, those in flight end
                    log.exception("an engine iteration failed; every request in flight ends with an error")
                    self.engine.fail_all()
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    async def stream(self, request: Request) -> AsyncIterator[list[int] | RequestResult]:
        """Each batch of committed tokens as a list, then the :class:`RequestResult` (finish
        reason, per-step draft / accepted lengths) last. Leaving early aborts the request;
        ``athrow(StopStream())`` ends it with finish reason ``stop`` instead (a stop string the
        caller found in the text).

        Raises:
            DFlashError: the request is invalid (empty prompt, more KV than the whole cache, ...).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sid = self.engine.add_request(
            request,
            on_tokens=lambda _sid, toks: loop.call_soon_threadsafe(queue.put_nowait, list(toks)),
            on_finish=lambda _sid, out: loop.call_soon_threadsafe(queue.put_nowait, out),
        )
        self._wake.set()
        finished, reason = False, "abort"
        try:
            while not isinstance(item := await queue.get(), RequestResult):
                yield item
            finished = True
            yield item
        except StopStream:
            reason = "stop"
        finally:
            if not finished:
                self.engine.abort(sid, reason)
                self._wake.set()

    def submit(
        self,
        request: Request,
        on_tokens: TokenCallback | None = None,
        on_finish: Callable[[int, RequestResult], None] | None = None,
        seq_id: int | None = None,
    ) -> int:
        """Queue a request with callbacks (run on the engine thread) and wake the loop; returns
        its sequence id (see :meth:`LLMEngine.add_request`)."""
        sid = self.engine.add_request(request, on_tokens, seq_id=seq_id, on_finish=on_finish)
        self._wake.set()
        return sid

    async def generate(self, request: Request) -> AsyncIterator[list[int]]:
        """Each batch of committed tokens (see :meth:`stream`)."""
        async for item in self.stream(request):
            if isinstance(item, list):
                yield item

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
