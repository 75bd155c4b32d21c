"""The agreement tool's counting (tools/bench/agreement.py): pairs, lane counts, and where two
replies part ways. The tool itself runs against real servers (docs/benchmarks.md)."""

from tools.bench.agreement import compare, first_difference, prompts_for, table


def test_first_difference_is_none_for_the_same_text_and_the_first_differing_char_otherwise():
    assert first_difference("abc", "abc") is None
    assert first_difference("abcd", "abXd") == 2
    assert first_difference("abc", "abcdef") == 3  # one stopped earlier


def test_every_pair_is_counted_per_lane_count():
    replies = {"s": {1: ["a", "b"], 4: ["a", "c"]},
               "l": {1: ["a", "b"], 4: ["a", "b"]},
               "generate": {1: ["a", "x"], 4: ["a", "b"]}}
    rows = compare(replies, [1, 4])
    got = {(r["a"], r["b"]): {L: (c["identical"], c["of"]) for L, c in r["cells"].items()} for r in rows}
    assert got == {("s", "l"): {1: (2, 2), 4: (1, 2)},
                   ("s", "generate"): {1: (1, 2), 4: (1, 2)},
                   ("l", "generate"): {1: (1, 2), 4: (2, 2)}}
    assert rows[0]["cells"][4]["first_difference_chars"] == [0]
    assert "| s = l | 2/2 | 1/2 |" in table(rows, [1, 4])


def test_each_lane_count_has_its_own_distinct_prompts():
    one, four = prompts_for(8, 1), prompts_for(8, 4)
    assert len(set(one)) == 8 and not set(one) & set(four)
