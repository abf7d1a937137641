"""Streaming detokenization and stop strings, on the bundled model's byte-level tokenizer."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.server.detokenizer import (
    MAX_HELD_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopChecker,
)

BAD = "\ufffd"
TEXTS = [
    "Hello, world! How are you today?",
    "Party time 🎉🎉 with family 👨‍👩‍👧 and flags 🇫🇷🇯🇵.",
    "中文字符测试，日本語のテキスト、한국어 텍스트.",
    "Café déjà vu, naïve façade, Ångström, Ελληνικά, русский.",
    "def f(x):\n    if x:\n        return [y for y in x]\n\treturn None\n",
    "Answer: 42.<|im_end|>\n<|im_start|>user\nMore? 🙂<|im_end|>",
    "  leading spaces, trailing spaces   \n\n\n",
    "math: ∑ x² ≤ ∞, arrows → ⇒, box ▁ and replacement \ufffd inside.",
]


def _byte_tokens() -> dict[int, str]:
    """GPT-2's byte -> vocabulary character map, which byte-level BPE uses."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in visible}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


@pytest.fixture(scope="module")
def tok(model_folder: Path) -> Tokenizer:
    return Tokenizer(model_folder)


@pytest.fixture(scope="module")
def byte_id(tok: Tokenizer) -> dict[int, int]:
    """Token id of each single byte in the vocabulary (a few, e.g. 0xC0 and 0xFF, are not)."""
    ids = {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    byte_ids = {b: ids[c] for b, c in _byte_tokens().items() if c in ids}
    assert len(byte_ids) == 235
    return byte_ids


def _stream(
    tok: Tokenizer,
    ids: list[int],
    chunk: int = 1,
    prompt: list[int] | None = None,
    skip: bool = True,
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert detok.text == "".join(deltas)
    return [*deltas, detok.flush()]


def test_byte_map_matches_the_vocabulary(tok: Tokenizer, byte_id: dict[int, int]) -> None:
    assert tok.decode([byte_id[0x41], byte_id[0x20], byte_id[0x0A]]) == "A \n"
    assert tok.decode([byte_id[0xE4], byte_id[0xB8], byte_id[0xAD]]) == "中"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_the_full_decode(
    tok: Tokenizer, text: str, skip: bool, chunk: int
) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids, chunk, skip=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert deltas[-1] == ""  # valid text: nothing is left to flush
    assert not any(d.endswith(BAD) for d in deltas) or BAD in text


def test_special_tokens_follow_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi.<|im_end|>")
    assert ids[-1] == tok.eos_token_id
    assert "".join(_stream(tok, ids, skip=True)) == "Hi."
    assert "".join(_stream(tok, ids, skip=False)) == "Hi.<|im_end|>"


def test_emoji_split_over_tokens_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a 🎉x")
    assert [tok.id_to_token(i) for i in ids] == ["a", "ĠðŁ", "İ", "ī", "x"]
    assert _stream(tok, ids) == ["a", "", "", " 🎉", "x", ""]


def test_character_split_into_single_bytes(tok: Tokenizer, byte_id: dict[int, int]) -> None:
    ids = [byte_id[b] for b in "é中🎉!".encode()]
    assert _stream(tok, ids) == ["", "é", "", "", "中", "", "", "", "🎉", "!", ""]


def test_skipped_special_token_inside_a_character(tok: Tokenizer, byte_id: dict[int, int]) -> None:
    ids = [byte_id[0xE4], tok.eos_token_id or 0, byte_id[0xB8], byte_id[0xAD]]
    assert _stream(tok, ids, skip=True) == ["", "", "", "中", ""]
    # Not skipped, the special token ends the byte run: each piece is broken.
    assert _stream(tok, ids, skip=False) == ["", BAD + "<|im_end|>", "", "", BAD + BAD]


def test_incomplete_character_at_the_end_is_flushed(
    tok: Tokenizer, byte_id: dict[int, int]
) -> None:
    ids = [*tok.encode("ok "), byte_id[0xF0], byte_id[0x9F]]
    assert _stream(tok, ids) == ["ok", " ", "", "", BAD]
    assert tok.decode(ids) == "ok " + BAD


def test_prompt_is_context_only(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi 中文"}]))
    assert len(prompt) > PROMPT_CONTEXT_TOKENS
    output = tok.encode(" Hello there 👋<|im_end|>")
    for skip in (True, False):
        deltas = _stream(tok, output, prompt=prompt, skip=skip)
        assert "".join(deltas) == tok.decode(output, skip_special_tokens=skip)
        assert deltas[:3] == [" Hello", " there", ""]


def test_prompt_ending_inside_a_character_is_ignored(
    tok: Tokenizer, byte_id: dict[int, int]
) -> None:
    prompt = [*tok.encode("say "), byte_id[0xE4]]
    output = [byte_id[0xB8], byte_id[0xAD], *tok.encode("!")]
    # The output alone starts with two stray continuation bytes.
    assert _stream(tok, output, prompt=prompt) == ["", "", BAD + BAD + "!", ""]


def _spy_on_decode(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of every decode call the detokenizer makes."""
    decoded_lengths: list[int] = []
    decode = tok.decode

    def spy(ids: list[int], *, skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(ids))
        return decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    return decoded_lengths


def test_invalid_byte_runs_are_released_in_bounded_windows(
    tok: Tokenizer, byte_id: dict[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded_lengths = _spy_on_decode(tok, monkeypatch)
    detok = IncrementalDetokenizer(tok)
    for _ in range(100):
        detok.add_tokens([byte_id[0x80]])  # a continuation byte can never start a character
    # Holds of MAX_HELD_TOKENS + 1 tokens, released but for the last token: 96 of 100.
    assert MAX_HELD_TOKENS == 8
    assert detok.text == BAD * 96
    assert detok.flush() == BAD * 4
    assert max(decoded_lengths) <= 2 * MAX_HELD_TOKENS + 2

    # A lead byte followed by a lead byte is broken too, but the last one may still complete.
    detok = IncrementalDetokenizer(tok)
    for _ in range(50):
        detok.add_tokens([byte_id[0xE4]])
    detok.add_tokens([byte_id[0xB8], byte_id[0xAD]])
    assert detok.text + detok.flush() == BAD * 49 + "中"
    assert detok.text == BAD * 49 + "中"


def test_window_stays_small_on_long_text(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(" ".join(TEXTS) * 20)
    decoded_lengths = _spy_on_decode(tok, monkeypatch)
    deltas = _stream(tok, ids)
    monkeypatch.undo()
    assert len(ids) > 2000
    assert "".join(deltas) == tok.decode(ids)
    assert max(decoded_lengths) <= 8


def _check_random_ids(
    tok: Tokenizer, ids: list[int], prompt: list[int], chunk: int, skip: bool
) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas = _stream(tok, ids, chunk, prompt=prompt, skip=skip)
    streamed = "".join(deltas[:-1])
    assert streamed + deltas[-1] == full
    assert full.startswith(streamed)
    if not full.endswith(BAD):
        assert deltas[-1] == ""


def test_random_token_ids_concatenate_to_the_full_decode(
    tok: Tokenizer, byte_id: dict[int, int]
) -> None:
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(sorted(byte_id.values())),
        st.integers(0, 16),  # special tokens
    )

    @settings(max_examples=400, deadline=None)
    @given(
        ids=st.lists(token, max_size=40),
        prompt=st.lists(token, max_size=8),
        chunk=st.integers(1, 4),
        skip=st.booleans(),
    )
    def check(ids: list[int], prompt: list[int], chunk: int, skip: bool) -> None:
        _check_random_ids(tok, ids, prompt, chunk, skip)

    check()


def test_random_byte_runs_concatenate_to_the_full_decode(
    tok: Tokenizer, byte_id: dict[int, int]
) -> None:
    """Long runs of broken bytes, released in pieces past MAX_HELD_TOKENS."""
    high_bytes = sorted(i for b, i in byte_id.items() if b >= 0x80)
    token = st.one_of(st.sampled_from(high_bytes), st.sampled_from([0, 2, byte_id[0x41]]))

    @settings(max_examples=400, deadline=None)
    @given(ids=st.lists(token, max_size=60), chunk=st.integers(1, 3), skip=st.booleans())
    def check(ids: list[int], chunk: int, skip: bool) -> None:
        _check_random_ids(tok, ids, [], chunk, skip)

    check()


# --- stop strings -----------------------------------------------------------------------------


def test_partial_stop_string_is_held_then_released() -> None:
    checker = StopChecker(["\n\nHuman:"])
    assert checker.feed("Hello\n\nHu") == ("Hello", None)
    assert checker.feed("mid") == ("\n\nHumid", None)
    assert checker.feed(" air\n") == (" air", None)
    assert checker.flush() == "\n"
    assert checker.matched is None


def test_stop_string_spanning_deltas() -> None:
    checker = StopChecker(["\n\nHuman:"])
    assert [checker.feed(d) for d in ["Sure.", "\n", "\nHum", "an: next"]] == [
        ("Sure.", None),
        ("", None),
        ("", None),
        ("", "\n\nHuman:"),
    ]
    assert checker.matched == "\n\nHuman:"
    assert checker.feed("more") == ("", "\n\nHuman:")
    assert checker.flush() == ""


def test_stop_string_inside_one_delta() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("abc STOP def STOP") == ("abc ", "STOP")


def test_first_completed_stop_string_wins() -> None:
    assert StopChecker(["world", "lo w"]).feed("hello world") == ("hel", "lo w")
    assert StopChecker(["abcd", "bc"]).feed("abcd") == ("a", "bc")
    # Ending at the same character: the longer one, which starts earlier.
    assert StopChecker(["b", "ab"]).feed("xab") == ("x", "ab")
    assert StopChecker(["ab", "b"]).feed("xab") == ("x", "ab")


def test_without_stop_strings_nothing_is_held() -> None:
    for stop in ([], [""], ["", ""]):
        checker = StopChecker(stop)
        assert checker.stop == []
        assert checker.feed("any text\n\n") == ("any text\n\n", None)
        assert checker.flush() == ""


def test_duplicate_stop_strings_are_merged() -> None:
    assert StopChecker(["x", "", "y", "x"]).stop == ["x", "y"]


def _reference_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text before the stop string completed first (longest on ties), character by char."""
    for end in range(len(text) + 1):
        ending = [s for s in stop if s and text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return text[: end - len(s)], s
    return text, None


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab\n ", max_size=30),
    stop=st.lists(st.text(alphabet="ab\n ", max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_checker_matches_reference_for_any_chunking(
    text: str, stop: list[str], cuts: list[int]
) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    checker = StopChecker(stop)
    emitted = ""
    for start, end in pairwise(bounds):
        out, matched = checker.feed(text[start:end])
        emitted += out
        if matched is None:
            # What is held back is exactly a beginning of a stop string.
            held = text[len(emitted) : end]
            assert not held or any(s.startswith(held) and s != held for s in checker.stop)
    emitted += checker.flush()
    assert (emitted, checker.matched) == _reference_stop(text, stop)


def test_detokenizer_and_stop_checker_together(tok: Tokenizer) -> None:
    ids = tok.encode("Sure! 🎉\n\nHuman: what now?")
    detok, checker = IncrementalDetokenizer(tok), StopChecker(["\n\nHuman:"])
    steps = []
    for token in ids:
        steps.append(checker.feed(detok.add_tokens([token])))
        if steps[-1][1] is not None:
            break
    assert steps == [
        ("Sure", None),
        ("!", None),
        ("", None),  # the emoji's first bytes, held by the detokenizer
        ("", None),
        (" 🎉", None),
        ("", None),  # "\n", "\n", "Human": held by the stop checker
        ("", None),
        ("", None),
        ("", "\n\nHuman:"),
    ]
    assert detok.text == "Sure! 🎉\n\nHuman:"
