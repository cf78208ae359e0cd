"""Incremental detokenization and stop strings: turning a stream of token ids into a stream of text.

A byte-level BPE (GPT-2's, Llama 3's, the lab's) has tokens for bytes, not characters: every
token stands for a few bytes, and a character outside ASCII is 2 to 4 bytes of UTF-8 that a
token boundary may cut anywhere. The lab's 4,096-token vocabulary cuts "é" into two tokens
(0xC3, 0xA9) and "🎉" into four. Decoding each token on its own therefore yields U+FFFD
(a broken character) for every piece of such a character.

The fix: turn each token back into its raw bytes and feed them to an incremental UTF-8 decoder
(``codecs``), which returns every character that is complete and holds back the 1 to 3 bytes
of one that is not yet, exactly as many as the next token must finish. Token text to bytes goes
through the byte-level alphabet: the 188 bytes that print as themselves keep their character,
the other 68 (space, control bytes, ...) are shifted to U+0100, U+0101, ... (so " " is "Ġ").
At the end, ``flush`` turns bytes that never formed a character into U+FFFD, as
``tokenizer.decode`` does; streamed or not, the text is the same:

    "".join(d.add(t) for t in ids) + d.flush() == tokenizer.decode(ids)

A tokenizer without a byte-level decoder (SentencePiece style) gets vLLM's window method:
decode the few ids since the last emitted text, and emit the new suffix once it does not end in
U+FFFD.

``StopStrings`` applies OpenAI's ``stop``: the output ends right before the first stop string
produced, which is not returned. "First" is the one completed first (the earliest end; of two
ending together, the longer): what a server sees token by token, so the cut does not depend on
how the text arrives in pieces. While streaming, only the longest tail of the text that could
still begin a stop string is held back; everything before it is emitted at once.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from functools import cache

from tokenizers import Tokenizer, decoders

MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`


@cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a token string uses -> the byte it stands for."""
    printable = [b for b in range(256) if chr(b).isprintable() and not chr(b).isspace()]
    shifted = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return mapping


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level token string stands for; a string outside the alphabet (an added
    token written in plain text, such as ``"<｜end▁of▁sentence｜>"``) stands for its own UTF-8,
    as in ``tokenizers``."""
    alphabet = byte_of_char()
    if all(c in alphabet for c in token):
        return bytes(alphabet[c] for c in token)
    return token.encode("utf-8")


class IncrementalDetokenizer:
    """Text of one sequence, token by token: ``add`` returns what each token completes."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # window method: ids from the window's start
        self._read = 0             # window method: ids[:_read] are already emitted

    def add(self, token_id: int) -> str:
        """The text this token completes; "" while a character is still incomplete."""
        if self.skip_special_tokens and token_id in self._special:
            return ""
        if not self._byte_level:
            return self._add_to_window(token_id)
        token = self.tokenizer.id_to_token(token_id)  # None outside the vocabulary: decode drops it too
        return self._utf8.decode(token_bytes(token)) if token is not None else ""

    def flush(self) -> str:
        """At the end: what is left, with bytes that never formed a character as U+FFFD."""
        if not self._byte_level:
            rest = self._window_text()[1]
            self._read = len(self._ids)
            return rest
        return self._utf8.decode(b"", final=True)

    def _window_text(self) -> tuple[str, str]:
        """(text of the window, the part of it not emitted yet)."""
        decode = self.tokenizer.decode
        emitted = decode(self._ids[:self._read], skip_special_tokens=self.skip_special_tokens)
        text = decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        return text, text[len(emitted):]

    def _add_to_window(self, token_id: int) -> str:
        self._ids.append(token_id)
        text, new = self._window_text()
        if not new or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read:]  # the emitted tokens before the last emission are context enough
        self._read = len(self._ids)
        return new


class StopStrings:
    """OpenAI's ``stop``: cut the streamed text right before the first stop string completed."""

    def __init__(self, stops: str | Sequence[str]) -> None:
        stops = [stops] if isinstance(stops, str) else list(stops)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stops)} strings; OpenAI's API allows at most {MAX_STOP_STRINGS}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = stops
        self.stopped = False
        self._held = ""

    def add(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found); after a stop, always ("", True)."""
        if self.stopped:
            return "", True
        text = self._held + text
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]  # (end, start)
        if found:
            self.stopped, self._held = True, ""
            return text[:min(found)[1]], True
        keep = self._possible_start(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """At the end of the output: the held-back tail, which no stop string completed."""
        held, self._held = self._held, ""
        return held

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        return max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
