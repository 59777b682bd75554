"""Per-request text post-processing shared by backends that sample token ids.

* :class:`IncrementalDetokenizer` wraps ``tokenizers.decoders.DecodeStream``:
  it returns text only once the bytes form whole UTF-8 characters, so a stream
  never carries a broken code point or a U+FFFD that the full decode lacks.
* :class:`StopStringFilter` holds back the longest tail of the text that could
  still grow into a stop string, and cuts the text where one completes. Because
  every possible beginning of a stop string is held back, a stop can never
  start inside text already sent.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        out = self._stream.step(self._tokenizer, token_id)
        return out or ""


class StopStringFilter:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to send, whether a stop string completed)."""
        if not self._stops:
            return text, False
        self._pending += text
        cut = -1
        for s in self._stops:
            i = self._pending.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            out, self._pending = self._pending[:cut], ""
            return out, True
        hold = self._longest_stop_prefix_suffix()
        if hold:
            out, self._pending = self._pending[:-hold], self._pending[-hold:]
        else:
            out, self._pending = self._pending, ""
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        text = self._pending
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
