"""Token ids to streamed text with stop strings (torch-free; the router uses it too).

Text is emitted only once it is stable: multi-byte characters that span
tokens are held back by the incremental detokenizer, and a tail that could
still become a stop string is held back here. A stop string ends the text
(it is not included) and finishes the request.
"""

from __future__ import annotations

from shared.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, holdback_len


class TextOutput:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = stop
        self.text = ""  # all decoded text so far (up to a stop string, if one was hit)
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the newly emittable text."""
        if self.stopped:
            return ""
        return self._extend(self._detok.add(token_id))

    def finish(self) -> str:
        """The request ended: flush held-back text."""
        if not self.stopped:
            self._extend(self._detok.flush())
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _extend(self, new_text: str) -> str:
        if new_text:
            start = len(self.text)
            self.text += new_text
            if self._stop:
                idx = find_stop(self.text, self._stop, start)
                if idx is not None:
                    self.text = self.text[:idx]
                    self.stopped = True
        stable = len(self.text) if self.stopped else len(self.text) - holdback_len(self.text, self._stop)
        if stable <= self._emitted:
            return ""
        delta = self.text[self._emitted : stable]
        self._emitted = stable
        return delta
