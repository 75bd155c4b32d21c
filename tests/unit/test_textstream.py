"""TextStream: token bytes → released text, holding back split UTF-8 and possible stop strings."""

from __future__ import annotations

from superfluid.core.textstream import TextStream

EURO = "€".encode()  # 3 bytes: e2 82 ac
EMOJI = "😀".encode()  # 4 bytes

TABLE: dict[int, bytes] = {
    1: b"Hello",
    2: b" world",
    3: b"!",
    4: EURO[:1],
    5: EURO[1:],
    6: EMOJI[:2],
    7: EMOJI[2:3],
    8: EMOJI[3:],
    10: b"ST",
    11: b"OP",
    12: b" tail",
    13: b"S",
    14: b"x",
    15: b"END",
    16: b"a",
    17: b"b",
    18: b"c",
    19: b"",
}


def stream(*stop: str) -> TextStream:
    return TextStream(TABLE.__getitem__, stop)


def feed(ts: TextStream, tokens) -> list[str]:
    return [ts.push(t) for t in tokens]


def test_plain_tokens_released_immediately():
    ts = stream()
    assert feed(ts, [1, 2, 3]) == ["Hello", " world", "!"]
    assert ts.text == "Hello world!"
    assert ts.flush() == ""
    assert not ts.stopped


def test_plain_tokens_with_unrelated_stop_released_immediately():
    ts = stream("STOP")
    assert feed(ts, [1, 2, 3]) == ["Hello", " world", "!"]


def test_empty_token_releases_nothing():
    ts = stream()
    assert ts.push(19) == ""
    assert ts.push(1) == "Hello"


def test_split_utf8_character_held_until_complete():
    ts = stream()
    assert ts.push(1) == "Hello"
    assert ts.push(4) == ""          # first byte of €
    assert ts.push(5) == "€"         # completed
    assert ts.text == "Hello€"


def test_four_byte_character_over_three_tokens():
    ts = stream()
    assert feed(ts, [6, 7, 8]) == ["", "", "😀"]
    assert ts.text == "😀"


def test_stop_string_spanning_tokens_cuts_before_it():
    ts = stream("STOP")
    assert ts.push(1) == "Hello"
    assert ts.push(10) == ""         # "ST" could start "STOP"
    assert ts.push(11) == ""         # "STOP" complete: nothing of it is released
    assert ts.stopped
    assert ts.text == "Hello"
    # Nothing more once stopped.
    assert ts.push(12) == ""
    assert ts.flush() == ""
    assert ts.text == "Hello"


def test_stop_string_inside_one_token_cuts_text_before_it():
    table = {1: b"abcSTOPdef"}
    ts = TextStream(table.__getitem__, ("STOP",))
    assert ts.stop_string is None
    assert ts.push(1) == "abc"
    assert ts.stopped


def test_the_stop_string_that_matched_first_is_named():
    table = {1: b"ab END x HALT"}
    ts = TextStream(table.__getitem__, ("HALT", "END"))
    assert ts.push(1) == "ab "
    assert ts.stop_string == "END"  # the earliest in the text, not the first listed


def test_text_after_stop_in_same_token_is_dropped():
    table = {1: b"Hel", 2: b"lo STOP and more"}
    ts = TextStream(table.__getitem__, ("STOP",))
    assert ts.push(1) == "Hel"
    assert ts.push(2) == "lo "
    assert ts.text == "Hello "


def test_possible_stop_prefix_held_then_flushed():
    ts = stream("STOP")
    assert ts.push(1) == "Hello"
    assert ts.push(10) == ""         # held: "ST" may become "STOP"
    assert ts.flush() == "ST"        # generation ended without the stop string
    assert ts.text == "HelloST"
    assert not ts.stopped


def test_held_prefix_released_when_it_diverges():
    ts = stream("STOP")
    assert ts.push(10) == ""         # "ST"
    assert ts.push(14) == "STx"      # "STx" cannot start "STOP"
    assert not ts.stopped


def test_partial_holdback_keeps_only_the_possible_prefix():
    ts = stream("STOP")
    assert ts.push(14) == "x"
    assert ts.push(13) == ""         # "S"
    assert ts.push(13) == "S"        # "SS": only the last "S" may start "STOP"
    assert ts.push(14) == "Sx"
    assert ts.text == "xSSx"


def test_earliest_of_several_stop_strings_wins():
    table = {1: b"one END two STOP three"}
    ts = TextStream(table.__getitem__, ("STOP", "END"))
    assert ts.push(1) == "one "
    assert ts.stopped


def test_earliest_stop_across_tokens():
    # "bc" completes inside "abcEND"; "END" comes later; "abc" itself is a stop too.
    ts = stream("END", "bc", "abcd")
    assert ts.push(16) == ""         # "a" may start "abcd"
    assert ts.push(17) == ""         # "ab" may start "abcd"; "b" may start "bc"
    assert ts.push(18) == "a"        # "bc" found at index 1
    assert ts.stopped
    assert ts.text == "a"


def test_longest_possible_prefix_held_among_several_stops():
    ts = stream("xyz", "STOP")
    assert ts.push(1) == "Hello"
    assert ts.push(10) == ""          # "ST" for STOP
    assert ts.push(14) == "ST"         # "STx": "x" may start "xyz", so it is held
    assert ts.flush() == "x"
    assert ts.text == "HelloSTx"


def test_empty_stop_strings_ignored():
    ts = stream("")
    assert ts.push(1) == "Hello"
    assert not ts.stopped


def test_stop_string_with_multibyte_character():
    table = {1: b"price ", 2: EURO[:1], 3: EURO[1:], 4: b"5"}
    ts = TextStream(table.__getitem__, ("€",))
    assert ts.push(1) == "price "
    assert ts.push(2) == ""
    assert ts.push(3) == ""
    assert ts.stopped
    assert ts.text == "price "


def test_flush_drops_an_unfinished_character():
    ts = stream()
    assert ts.push(1) == "Hello"
    assert ts.push(6) == ""  # half an emoji: held back
    assert ts.flush() == ""  # the generation ended there: dropped, never U+FFFD
    assert ts.text == "Hello"


def test_flush_releases_what_was_held_for_a_stop_but_drops_the_broken_tail():
    ts = TextStream(TABLE.__getitem__, ("STOP",))
    assert ts.push(10) == ""  # "ST" could start the stop string
    assert ts.push(4) == ""   # then a character's first byte
    assert ts.flush() == "ST"
    assert ts.text == "ST"


def test_invalid_bytes_in_the_middle_are_still_replaced():
    table = {1: b"a\xff", 2: b"b"}
    ts = TextStream(table.__getitem__)
    assert ts.push(1) + ts.push(2) + ts.flush() == "a\ufffdb"  # not a partial character: bad bytes
