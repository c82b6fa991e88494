"""Text from a growing list of sampled ids, one step at a time, with stop strings.

Why not decode each new id alone: byte-level BPE splits a multi-byte
character over several ids (alone, each decodes to U+FFFD), and
sentencepiece drops a word's leading space when a piece is decoded on its
own. So the text of new ids is the difference between decoding a short
window that ends with them and the same window without them, and a
difference that ends in U+FFFD (an unfinished character) waits for the next
id. This is vLLM's incremental scheme; decoding costs a few ids per step, not
the whole output.

Stop strings end a choice as soon as the text contains one: the text is cut
before it (or after it with ``include_stop_str_in_output``). While a choice
runs, the last ``longest stop - 1`` characters are held back, so a stream
never shows the start of a stop string that later turns out to be one (not
with ``include_stop_str_in_output``: the stop string is shown anyway, and
vLLM holds nothing back then either).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.openai.tokenizer import Tokenizer

_WINDOW = 6  # ids of context before the unread ones: enough for a merge or a leading space to resolve


class IncrementalDetokenizer:
    """One choice's text. Not thread-safe: its owner (the worker's step loop) feeds it.

    :meth:`push` takes the ids sampled in one step and returns the text that
    may be shown now, and the stop string that ended the choice (None while
    it runs). After a stop string, or when the choice ends for another reason
    (:meth:`finish`), nothing more is shown.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        """``context``: the ids before the output (the prompt's tail), so the first word decodes as it follows."""
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        # A stop string may straddle two steps' text: each search starts this far back. The same many
        # characters are held back from the stream, unless the stop string is to be shown anyway (vLLM).
        self._reach = max((len(s) for s in self._stop), default=1) - 1
        self._hold = 0 if include_stop_str_in_output else self._reach
        self._ids: list[int] = list(context[-_WINDOW:])
        self._prefix_offset = 0  # ids[prefix_offset:read_offset]: the window already turned into text
        self._read_offset = len(self._ids)
        self.text = ""  # everything decoded so far (the shown part is text[:shown])
        self._shown = 0
        self.stopped = False

    def push(self, token_ids: Sequence[int], *, search_stop: bool = True) -> tuple[str, str | None]:
        """Add ids; returns (text to show now, the stop string that matched or None).

        ``search_stop`` False adds the text without looking for stop strings (vLLM does not stop
        a choice before its ``min_tokens``); held-back text is still held back.
        """
        if self.stopped:
            return "", None
        self._ids.extend(token_ids)
        before = len(self.text)
        self.text += self._decode_new()
        if self._stop and search_stop:
            # A stop string may straddle the old text and the new, but must end in the new (vLLM's window):
            # search from where one could start, each by its own length.
            for stop in self._stop:
                found = self.text.find(stop, max(0, before - len(stop) + 1))
                if found >= 0:
                    end = found + len(stop) if self._include_stop else found
                    self.text = self.text[:end]
                    self.stopped = True
                    return self._show(len(self.text)), stop
        return self._show(len(self.text) - self._hold), None

    def finish(self) -> str:
        """The choice ended (length, EOS, a stop id): the held-back text, decoded to the end -- less an
        unfinished character at the very end (U+FFFD), which vLLM never shows either."""
        if self.stopped:
            return ""
        self.stopped = True
        tail = self._tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        tail = tail.rstrip("\ufffd")
        done = self._tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special
        )
        if len(tail) > len(done):
            self.text += tail[len(done) :]
        return self._show(len(self.text))

    def _decode_new(self) -> str:
        done = self._tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special
        )
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(full) <= len(done) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or an unfinished character: wait for the next id
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _WINDOW)
        return full[len(done) :]

    def _show(self, upto: int) -> str:
        upto = max(upto, self._shown)
        out = self.text[self._shown : upto]
        self._shown = upto
        return out
