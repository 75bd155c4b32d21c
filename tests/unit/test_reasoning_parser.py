"""core.reasoning: a reply's <think> span split from its answer, whatever the deltas' cuts."""

import itertools

import pytest

from superfluid.core.reasoning import THINK, Markers, ReasoningParser
from superfluid.plugins.formats.reasoning import THINK as THINK_FORMAT


def run(deltas, inside=False, markers=THINK):
    parser = ReasoningParser(markers, inside=inside)
    reasoning, content = [], []
    for d in deltas:
        r, c = parser.feed(d)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content), reasoning, content


def splits(text, cuts):
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


REPLY = "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4."


@pytest.mark.parametrize("cut", range(1, len(REPLY)))
def test_every_single_cut(cut):
    r, c, rs, cs = run(splits(REPLY, [cut]))
    assert (r, c) == ("Let me see: 2+2.", "It is 4.")
    assert not any("<" in x or ">" in x for x in rs + cs)


def test_every_pair_of_cuts_and_char_by_char():
    for a, b in itertools.combinations(range(1, len(REPLY)), 2):
        r, c, rs, cs = run(splits(REPLY, [a, b]))
        assert (r, c) == ("Let me see: 2+2.", "It is 4."), (a, b)
        assert not any("think>" in x or x.endswith("<") for x in rs + cs), (a, b)
    assert run(list(REPLY))[:2] == ("Let me see: 2+2.", "It is 4.")


@pytest.mark.parametrize("marker,k", [(m, k) for m in ("<think>", "</think>") for k in range(1, len(m))])
def test_marker_split_never_leaks(marker, k):
    """A marker split at every position: no piece of it reaches either field, delta by delta."""
    if marker == "<think>":
        deltas = ["<think>"[:k], "<think>"[k:] + "idea</think>answer"]
    else:
        deltas = ["<think>idea" + "</think>"[:k], "</think>"[k:] + "answer"]
    r, c, rs, cs = run(deltas)
    assert (r, c) == ("idea", "answer")
    for piece in rs + cs:
        assert piece in ("", "idea", "answer"), piece


def test_streamed_pieces_arrive_as_they_come():
    parser = ReasoningParser()
    assert parser.feed("<think>") == ("", "")
    assert parser.in_span
    assert parser.feed("first ") == ("first", "")
    assert parser.feed("second") == (" second", "")
    assert parser.feed("</think>") == ("", "")
    assert not parser.in_span
    assert parser.feed("\n\nDone") == ("", "Done")
    assert parser.feed(" now") == ("", " now")
    assert parser.finish() == ("", "")


def test_no_span_is_all_content():
    assert run(["Hello", " there <think> not a span"])[:2] == ("", "Hello there <think> not a span")
    assert run(["<", "div>x</div>"])[:2] == ("", "<div>x</div>")
    assert run(["<thi"])[:2] == ("", "<thi")  # cut off before it could open: text
    assert run([""])[:2] == ("", "")


def test_cut_off_inside_the_span_is_reasoning():
    assert run(["<think>", "still thinking", " about it</th"])[:2] == ("still thinking about it</th", "")
    assert run(["<think>\n", "hmm\n"])[:2] == ("hmm", "")


def test_leading_whitespace_before_the_span():
    assert run(["\n", " <thi", "nk>a</think>b"])[:2] == ("a", "b")


def test_starts_inside():
    assert run(["Let me", " think.</think>", "\n\nAnswer."], inside=True)[:2] == ("Let me think.", "Answer.")
    # the model writes the start marker again anyway: dropped
    assert run(["<think>\nx", "</think>y"], inside=True)[:2] == ("x", "y")
    # cut off: all reasoning
    assert run(["never", " ends"], inside=True)[:2] == ("never ends", "")
    # the span closed at once (no reasoning)
    assert run(["</think>\n\nok"], inside=True)[:2] == ("", "ok")


@pytest.mark.parametrize("cut", range(1, 30))
def test_starts_inside_every_cut(cut):
    text = "I reason here.\n</think>\n\nFine."
    if cut >= len(text):
        pytest.skip("past the end")
    assert run(splits(text, [cut]), inside=True)[:2] == ("I reason here.", "Fine.")


def test_text_after_the_span_keeps_its_markers():
    assert run(["<think>a</think>b <think>c</think>"])[:2] == ("a", "b <think>c</think>")


def test_other_markers():
    markers = Markers("[THINK]", "[/THINK]")
    text = "[THINK]plan[/THINK]done"
    for cut in range(1, len(text)):
        assert run(splits(text, [cut]), markers=markers)[:2] == ("plan", "done")


def test_detect_and_starts_inside():
    # the serving path's detection and opened-span check: the think format's
    assert THINK_FORMAT.detect("{{ '<think>\\n' }}{{ '</think>' }}") > 0
    assert THINK_FORMAT.detect("{% for m in messages %}{{ m.content }}{% endfor %}") == 0
    assert THINK_FORMAT.opened_by("<|im_start|>assistant\n<think>\n")
    assert not THINK_FORMAT.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK_FORMAT.opened_by("<|im_start|>assistant\n")
