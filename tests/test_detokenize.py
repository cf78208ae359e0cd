"""Incremental detokenization streams exactly ``tokenizer.decode`` and never a broken character;
stop strings cut the stream as OpenAI's ``stop`` does."""
from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from labkit.detokenize import IncrementalDetokenizer, StopStrings, byte_of_char
from labkit.load import TOKENIZER

TEXTS = [
    "café au lait, naïve façade, Ångström, Æsir, œuvre",
    "東京都の天気は晴れです。中文测试，한국어 텍스트",
    "🎉🚀 party 👩‍👩‍👧‍👦 family, 👍🏽 thumbs, 🇫🇷 flag",
    "mixed: x = 3 × 4 ≈ 12 — “quoted” ‘single’ … done",
    "e\u0301 combining, \u00a0nbsp, tab\tand\nnewline, null\x00byte, \U0001d11e clef",
]
EMOJI = "🎉"


@cache
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The pieces a detokenizer emits for ``ids``, the flush last."""
    d = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return [d.add(i) for i in ids] + [d.flush()]


@cache
def byte_token_id() -> dict[int, int]:
    """byte -> id of the vocabulary's single-byte token for it."""
    return {b: tok().token_to_id(c) for c, b in byte_of_char().items()}


def byte_ids(data: bytes) -> list[int]:
    return [byte_token_id()[b] for b in data]


def splits(data: bytes, limit: int = 2000) -> list[list[int]]:
    """Every way (up to ``limit``) to write ``data`` as a sequence of vocabulary tokens."""
    vocab = {bytes(byte_of_char()[c] for c in s): i for s, i in tok().get_vocab(with_added_tokens=False).items()}
    longest = max(map(len, vocab))
    found: list[list[int]] = []

    def walk(start: int, ids: list[int]) -> None:
        if len(found) >= limit:
            return
        if start == len(data):
            found.append(ids)
        for end in range(start + 1, min(len(data), start + longest) + 1):
            if data[start:end] in vocab:
                walk(end, ids + [vocab[data[start:end]]])

    walk(0, [])
    return found


def test_byte_alphabet_is_the_tokenizers_one():
    mapping = byte_of_char()
    assert set(mapping) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(mapping.values()) == list(range(256))
    assert mapping["Ġ"] == ord(" ") and mapping["Ċ"] == ord("\n") and mapping["a"] == ord("a")


def test_every_token_alone_streams_to_its_decode():
    t = tok()
    for i in range(t.get_vocab_size()):
        assert "".join(stream(t, [i], skip_special_tokens=False)) == t.decode([i], skip_special_tokens=False), i


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_streams_to_the_full_decode(text):
    t = tok()
    ids = t.encode(text).ids
    assert "".join(stream(t, ids)) == t.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_every_piece_is_whole_characters_as_soon_as_they_are_complete(text):
    """After each token, the text so far is exactly the complete characters of its bytes: no U+FFFD,
    no character held back longer than needed."""
    t = tok()
    ids = t.encode(text).ids
    d = IncrementalDetokenizer(t)
    so_far = ""
    for k, i in enumerate(ids, 1):
        piece = d.add(i)
        assert "\ufffd" not in piece
        so_far += piece
        assert so_far == t.decode(ids[:k]).removesuffix("\ufffd"), k  # an incomplete tail decodes to one U+FFFD
    assert d.flush() == ""


@pytest.mark.parametrize("text", ["café", "aé b", "世界 hi", "🎉 yes!", " naïve —", "👍🏽 ok", "x€y z"])
def test_every_token_split_streams_to_the_text(text):
    t = tok()
    ways = splits(text.encode())
    assert len(ways) > 1
    for ids in ways:
        pieces = stream(t, ids)
        assert "".join(pieces) == t.decode(ids) == text, ids
        assert not any("\ufffd" in p for p in pieces), ids


def test_emoji_in_single_byte_tokens_emits_nothing_until_its_last_byte():
    ids = byte_ids(EMOJI.encode())
    assert len(ids) == 4
    assert stream(tok(), ids) == ["", "", "", EMOJI, ""]


def test_a_token_that_ends_mid_character():
    """The vocabulary's one multi-byte token outside ASCII, b"\\xe2\\x80", is the start of "—", "…", "“"."""
    t = tok()
    ids = t.encode("a—").ids
    assert t.id_to_token(ids[-2]) == "âĢ"
    assert stream(t, ids) == ["a", "", "—", ""]


def test_incomplete_character_at_the_end_is_flushed_as_decode_does():
    t = tok()
    ids = byte_ids(b"ok" + EMOJI.encode()[:3])
    assert stream(t, ids) == ["o", "k", "", "", "", "\ufffd"]
    assert t.decode(ids) == "ok\ufffd"


def test_invalid_bytes_become_replacement_characters_like_decode():
    t = tok()
    ids = byte_ids(b"a\xff\xc3b\xe2\x82\xa9\x80")  # a stray byte, a cut 2-byte char, "₩", a lone continuation
    assert "".join(stream(t, ids)) == t.decode(ids) == "a\ufffd\ufffdb₩\ufffd"


def test_special_tokens_are_skipped_or_kept_as_decode_does():
    t = tok()
    eos = t.token_to_id("<|endoftext|>")
    ids = byte_ids("é".encode()[:1]) + [eos] + byte_ids("é".encode()[1:]) + [eos]
    assert stream(t, ids) == ["", "", "é", "", ""]
    assert t.decode(ids) == "é"
    kept = stream(t, ids, skip_special_tokens=False)
    assert "".join(kept) == t.decode(ids, skip_special_tokens=False) == "\ufffd<|endoftext|>\ufffd<|endoftext|>"


def test_added_tokens_written_in_plain_text_stream_as_decode_does():
    t = Tokenizer.from_str(tok().to_str())
    t.add_tokens(["snow ☃"])  # " " and "☃" are not in the byte-level alphabet
    t.add_special_tokens(["<｜end▁of▁sentence｜>"])
    ids = t.encode("a snow ☃ é<｜end▁of▁sentence｜>").ids
    assert t.token_to_id("snow ☃") in ids
    for skip in (True, False):
        assert "".join(stream(t, ids, skip)) == t.decode(ids, skip_special_tokens=skip)


def test_ids_outside_the_vocabulary_are_dropped_like_decode_does():
    t = tok()
    ids = t.encode("hi").ids + [t.get_vocab_size() + 7]
    assert "".join(stream(t, ids)) == t.decode(ids) == "hi"


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.sampled_from(range(128, 256)).map(lambda b: byte_token_id()[b]),
                              st.integers(0, 4095)), max_size=24),
       skip=st.booleans())
def test_any_token_ids_stream_to_exactly_decode(ids, skip):
    t = tok()
    assert "".join(stream(t, ids, skip)) == t.decode(ids, skip_special_tokens=skip)


# A SentencePiece-style tokenizer (Llama 2's decoder: "▁" for space, <0xNN> byte fallback), built here.
SP_CHARS = "▁abcdefghijklmnopqrstuvwxyz"


@cache
def sentencepiece_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    vocab.update({c: len(vocab) + k for k, c in enumerate(SP_CHARS)})
    vocab.update({"▁a": len(vocab), "▁t": len(vocab) + 1})
    t = Tokenizer(models.BPE(vocab, [("▁", "a"), ("▁", "t")], unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.add_special_tokens(["</s>"])
    return t


@pytest.mark.parametrize("text", ["a cat ate", *TEXTS])
def test_window_method_for_a_sentencepiece_tokenizer(text):
    t = sentencepiece_tokenizer()
    ids = t.encode(text).ids + [t.token_to_id("</s>")]
    pieces = stream(t, ids)
    assert "".join(pieces) == t.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_window_method_holds_a_character_split_over_byte_tokens():
    t = sentencepiece_tokenizer()
    ids = t.encode("a🎉").ids
    assert len(ids) == 5  # "▁a" and one <0xNN> token per byte of the emoji
    assert stream(t, ids) == ["a", "", "", "", "🎉", ""]
    assert stream(t, ids[:-1]) == ["a", "", "", "", "\ufffd" * 3]  # ByteFallback: one U+FFFD per byte left
    assert t.decode(ids[:-1]) == "a" + "\ufffd" * 3


@settings(max_examples=200, deadline=None)
@given(text=st.text("a t\n\x00é世🎉", max_size=12),
       extra=st.lists(st.integers(0, 1) | st.integers(258, 300), max_size=4), skip=st.booleans())
def test_window_method_valid_text_and_whole_tokens_stream_to_exactly_decode(text, extra, skip):
    """Not any ids: ByteFallback turns a whole run of byte tokens into U+FFFDs once one byte in it is
    invalid (decode([<0x00>, <0x80>]) == "\ufffd\ufffd"), which no stream can know before the run ends."""
    t = sentencepiece_tokenizer()
    ids = t.encode(text).ids + extra
    assert "".join(stream(t, ids, skip)) == t.decode(ids, skip_special_tokens=skip)


# Stop strings


def run_stops(stops, pieces: list[str]) -> tuple[list[str], bool]:
    s = StopStrings(stops)
    out, stopped = [], False
    for p in pieces:
        text, stopped = s.add(p)
        out.append(text)
    return out + [s.flush()], stopped


def test_stop_inside_one_piece():
    assert run_stops(["\n\n"], ["Hello\n\nWorld", "more"]) == (["Hello", "", ""], True)


def test_stop_split_across_pieces_is_held_then_dropped():
    assert run_stops(["END"], ["abc E", "N", "D and more"]) == (["abc ", "", "", ""], True)


def test_the_earliest_stop_wins_not_the_first_listed():
    assert run_stops(["world", "lo"], ["hello world"]) == (["hel", ""], True)
    assert run_stops(["world", "lo"], ["hel", "l", "o world"]) == (["he", "l", "", ""], True)


def test_the_stop_completed_first_wins_however_the_text_is_cut():
    """In "baa", "a" is complete (at 2) before "baa" (at 3) could be: generation stops there."""
    assert run_stops(["baa", "a"], ["baa"]) == (["b", ""], True)
    assert run_stops(["baa", "a"], ["ba", "a"]) == (["b", "", ""], True)
    assert run_stops(["b", "ab"], ["xab"]) == (["x", ""], True)  # both end at 3: the longer one starts first


def test_held_prefix_that_is_no_stop_is_emitted_when_it_breaks():
    assert run_stops(["END"], ["abc EN", "X"]) == (["abc ", "ENX", ""], False)


def test_only_the_longest_possible_start_is_held():
    """"xabcab" could begin "abcabd" from its 2nd character; after "c" only the last "abc" still could."""
    assert run_stops(["abcabd"], ["xabcab", "c", "d!"]) == (["x", "abc", "abcd!", ""], False)
    assert run_stops(["xyz"], ["hello", " there"]) == (["hello", " there", ""], False)


def test_flush_returns_the_held_tail():
    assert run_stops(["END", "STOP"], ["abc EN", "d ST"]) == (["abc ", "ENd ", "ST"], False)


def test_a_single_string_is_one_stop_and_no_stops_pass_everything():
    assert run_stops("ab", ["xab"]) == (["x", ""], True)
    assert run_stops([], ["abc"]) == (["abc", ""], False)


@pytest.mark.parametrize("stops, message", [
    ([""], "non-empty"), (["ok", 3], "non-empty strings"), (["a", "b", "c", "d", "e"], "at most 4"),
])
def test_bad_stops_are_refused(stops, message):
    with pytest.raises(ValueError, match=message):
        StopStrings(stops)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the whole text's output ends: before the stop that ends first (of those, the longest)."""
    for end in range(len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return end - max(map(len, done))
    return None


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=20), cuts=st.lists(st.integers(0, 20), max_size=6),
       stops=st.lists(st.text("abc", min_size=1, max_size=4), max_size=4))
def test_streamed_stops_equal_cutting_the_whole_text(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run_stops(stops, pieces)
    cut = first_stop(text, stops)
    assert "".join(out) == (text if cut is None else text[:cut])
    assert stopped == (cut is not None)
