"""Incremental detokenisation for streaming, and stop strings.

Decoding one token at a time loses the spaces that SentencePiece / byte-level BPE attach to
word starts and splits multi-byte UTF-8 characters; TensorRT-LLM's BLS fix
(``accumulate_tokens``) decodes everything accumulated and sends the new suffix. This does the
same, holding back a suffix that ends in an incomplete character (U+FFFD) and, when stop strings
are given, the longest suffix that could still grow into one (vLLM holds those back too).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Feed token ids, get the text that can be shown so far.

    Args:
        tokenizer: an HF tokenizer.
        stop: stop strings: the text ends before the first occurrence of any of them.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.sent = ""  # text already handed out
        self.stopped = False  # a stop string was found: nothing more comes

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the new text that is safe to send (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            text = text[: len(text.rstrip("\ufffd"))]
        hold = self._stop_prefix_len(text)
        return self._emit(text[: len(text) - hold])

    def finish(self) -> str:
        """The rest of the text at the end of generation (held-back text included)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        cut = self._first_stop(text)
        return self._emit(text if cut is None else text[:cut])

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return self.sent

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.sent):  # the tokenizer revised earlier text (rare): send nothing new
            return ""
        new = upto[len(self.sent) :]
        self.sent = upto
        return new

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s, max(0, len(self.sent) - len(s))) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
