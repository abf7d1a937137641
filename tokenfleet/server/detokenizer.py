"""Streaming text out of token ids: incremental detokenization and stop strings.

The HTTP gateway receives each request's new token ids once per engine step and streams text.
`IncrementalDetokenizer` turns those ids into text deltas without re-decoding the whole output:
it decodes a small window of trailing tokens (prefix offset to the end) and diffs it against
the window's part already emitted (prefix offset to read offset), as vLLM does. A byte-level
token can end inside a multi-byte UTF-8 character, which decodes to U+FFFD at the end of the
text; that text is held back until a later token completes the character.

`StopChecker` cuts the streamed text just before the first stop string, even one spread over
several deltas, and holds back a tail that may still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.checkpoint.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Trailing prompt tokens decoded as context of the output, so that a decoder which drops the
# leading space of the text it decodes (SentencePiece) keeps the first output word's space.
PROMPT_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character spans at most 3 bytes, so a hold longer than this many tokens
# is made of invalid bytes: it is released up to a boundary that no later byte can join.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns one request's output token ids, a few at a time, into text deltas.

    The deltas (with `flush` at the end) concatenate to ``tokenizer.decode(output_ids)`` for
    byte-level BPE tokenizers such as the bundled model's; no delta ends with half a character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: the output is decoded alone
        self._ids = context
        self._prefix_offset = 0  # start of the decoded window
        self._read_offset = len(context)  # end of the tokens whose text was emitted
        self._text = ""

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return self._text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append the step's new tokens; return the text they complete (maybe empty)."""
        self._ids.extend(new_token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: return the held-back text, broken characters included."""
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, *, final: bool) -> str:
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        end = len(ids)
        if end == read:
            return ""
        prefix_text = self._decode(ids[prefix:read])
        new_text = self._decode(ids[prefix:])
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            # The last bytes may begin a character that the next tokens complete.
            end = self._clean_end(new_text) if end - read > MAX_HELD_TOKENS else read
            if end == read:
                return ""
            new_text = self._decode(ids[prefix:end])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = read, end
        self._text += delta
        return delta

    def _clean_end(self, window_text: str) -> int:
        """The last token boundary past the read offset that no later byte can join, if any.

        Decoding the window in two pieces at a boundary gives the same text only if the bytes
        after it do not continue a character begun before it; then later bytes cannot either.
        """
        ids, prefix = self._ids, self._prefix_offset
        for end in range(len(ids) - 1, self._read_offset, -1):
            tail = self._decode(ids[end:])
            if tail and self._decode(ids[prefix:end]) + tail == window_text:
                return end
        return self._read_offset


class StopChecker:
    """Cuts streamed text just before the first stop string (which is not emitted).

    "First" is the stop string that is complete earliest in the text, the longest if several
    end at the same character, so the result does not depend on how the text was chunked.
    Empty stop strings are ignored.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]
        self.matched: str | None = None
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return the text to emit now and the stop string matched (None while none has).

        A tail that is the beginning of a stop string is held back until a later delta shows
        whether it is one. After a match the request is over: later deltas emit nothing.
        """
        if self.matched is not None:
            return "", self.matched
        text = self._held + delta
        found = [(text.find(s) + len(s), -len(s), s) for s in self.stop if s in text]
        if found:
            end, minus_length, self.matched = min(found)
            self._held = ""
            return text[: end + minus_length], self.matched
        held = max(
            (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
        self._held = text[len(text) - held :]
        return text[: len(text) - held], None

    def flush(self) -> str:
        """At the end of a request that did not stop: return the held-back text."""
        held, self._held = self._held, ""
        return held
