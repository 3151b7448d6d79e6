"""Rewards of reverse_text and alphabet_sort on hand-made replies, against the rules of the public environments."""

from difflib import SequenceMatcher

import plainrl_alphabet_sort as sort
import plainrl_reverse_text as rt
import pytest

# ---------------------------------------------------------------- reverse_text


def test_reverse_text_exact_answer_scores_one():
    assert rt.score("<reversed_text>olleh</reversed_text>", "hello") == 1.0
    assert rt.score(rt.reference_reply("Serious inside else."), "Serious inside else.") == 1.0


def test_reverse_text_missing_tag_scores_zero():
    assert rt.score("olleh", "hello") == 0.0


def test_reverse_text_unclosed_tag_scores_zero():
    assert rt.score("<reversed_text>olleh", "hello") == 0.0


def test_reverse_text_empty_tag_scores_zero():
    assert rt.score("<reversed_text></reversed_text>", "hello") == 0.0
    assert rt.score("<reversed_text>  \n </reversed_text>", "hello") == 0.0


def test_reverse_text_first_of_two_tags_counts():
    reply = "<reversed_text>xxxxx</reversed_text> <reversed_text>olleh</reversed_text>"
    assert rt.parse_answer(reply) == "xxxxx"
    assert rt.score(reply, "hello") == 0.0
    swapped = "<reversed_text>olleh</reversed_text> <reversed_text>xxxxx</reversed_text>"
    assert rt.score(swapped, "hello") == 1.0


def test_reverse_text_surrounding_whitespace_and_prose_are_ignored():
    assert rt.score("Sure!\n<reversed_text>\n  olleh \n</reversed_text>\nDone.", "hello") == 1.0


def test_reverse_text_inner_whitespace_counts():
    text = "ab cd"
    assert rt.score("<reversed_text>dc ba</reversed_text>", text) == 1.0
    assert (
        rt.score("<reversed_text>dcba</reversed_text>", text)
        == SequenceMatcher(None, "dcba", "dc ba").ratio()
    )


def test_reverse_text_unicode_is_reversed_by_code_point():
    text = "héllo wörld ✓"
    assert rt.score(f"<reversed_text>{text[::-1]}</reversed_text>", text) == 1.0
    assert rt.score(f"<reversed_text>{text}</reversed_text>", text) < 1.0


def test_reverse_text_partial_answer_is_the_difflib_ratio():
    reply = "<reversed_text>dlrow</reversed_text>"
    expected = SequenceMatcher(None, "dlrow", "dlrow olleh").ratio()
    assert rt.score(reply, "hello world") == pytest.approx(expected)
    assert 0 < expected < 1


def test_reverse_text_multiline_text():
    text = "line one\nline two"
    assert rt.score(f"<reversed_text>\n{text[::-1]}\n</reversed_text>", text) == 1.0


# ---------------------------------------------------------------- alphabet_sort

TURNS = [["CarolXu", "AliceZephyr"], ["BobYoung"], ["DaveWhite", "EveAdams"]]


def test_split_name_cuts_at_the_first_inner_capital():
    assert sort.split_name("VladimirDrinfeld") == ("Vladimir", "Drinfeld")
    assert sort.split_name("JohnMcDonald") == ("John", "McDonald")
    assert sort.split_name("Plato") == ("Plato", "")


def test_alphabet_sort_first_vs_last_name_order():
    by_first = sort.ground_truths(TURNS[:1], by_first=True)
    by_last = sort.ground_truths(TURNS[:1], by_first=False)
    assert by_first == [["AliceZephyr", "CarolXu"]]
    assert by_last == [["CarolXu", "AliceZephyr"]]
    # Sorting the wrong way round is penalised.
    reply = "<alphabetical_sorted>\nAliceZephyr\nCarolXu\n</alphabetical_sorted>"
    assert sort.score([reply], by_first, 4, True) == 1.0
    assert sort.score([reply], by_last, 4, True) < 1.0


def test_alphabet_sort_new_name_markers_only_on_that_turns_names():
    expected = sort.ground_truths(TURNS, by_first=True)
    assert expected[0] == ["AliceZephyr", "CarolXu"]  # no markers on turn 1
    assert expected[1] == ["AliceZephyr", "BobYoung // new name!", "CarolXu"]
    assert expected[2] == [
        "AliceZephyr",
        "BobYoung",
        "CarolXu",
        "DaveWhite // new name!",
        "EveAdams // new name!",
    ]


def test_alphabet_sort_reference_replies_score_one_with_any_power_rule():
    expected = sort.ground_truths(TURNS, by_first=False)
    replies = sort.reference_replies(expected)
    assert replies[0].startswith("<alphabetical_sorted>") and replies[1].startswith(
        "<combined_alphabetical_sorted>"
    )
    assert sort.score(replies, expected, 4, True) == 1.0
    assert sort.score(replies, expected, 8, False) == 1.0


def test_alphabet_sort_case_and_whitespace_are_ignored():
    reply = "<alphabetical_sorted>\n\n   alicezephyr  \n\nCAROLXU\n</alphabetical_sorted>"
    assert sort.score([reply], [["AliceZephyr", "CarolXu"]], 4, True) == 1.0


def test_alphabet_sort_missing_marker_costs_similarity():
    expected = sort.ground_truths(TURNS[:2], by_first=True)
    unmarked = (
        "<combined_alphabetical_sorted>\nAliceZephyr\nBobYoung\nCarolXu\n</combined_alphabetical_sorted>"
    )
    sim = sort.turn_similarity(unmarked, expected[1], "combined_alphabetical_sorted")
    assert 0.5 < sim < 1.0


def test_alphabet_sort_later_turns_need_the_combined_tag():
    expected = sort.ground_truths(TURNS[:2], by_first=True)
    replies = sort.reference_replies(expected)
    wrong_tag = replies[1].replace("combined_alphabetical_sorted", "alphabetical_sorted")
    assert sort.score([replies[0], wrong_tag], expected, 4, True) == 0.5


def test_alphabet_sort_missing_tag_and_empty_tag_score_zero():
    expected = [["AliceZephyr", "CarolXu"]]
    assert sort.score(["AliceZephyr\nCarolXu"], expected, 4, True) == 0.0
    assert sort.score(["<alphabetical_sorted>\n\n</alphabetical_sorted>"], expected, 4, True) == 0.0


def test_alphabet_sort_missing_turn_scores_zero_for_that_turn():
    expected = sort.ground_truths(TURNS, by_first=True)
    replies = sort.reference_replies(expected)
    assert sort.score(replies[:2], expected, 4, True) == pytest.approx(2 / 3)
    assert sort.score([], expected, 4, True) == 0.0


def test_alphabet_sort_non_improving_attempts_score_zero():
    good = "<alphabetical_sorted>\nAliceZephyr\nCarolXu\n</alphabetical_sorted>"
    bad = "<alphabetical_sorted>\nCarolXu\nAliceZephyr\n</alphabetical_sorted>"
    expected = [["AliceZephyr", "CarolXu"]]
    assert sort.score([good + bad], expected, 4, True) == 0.0  # got worse
    assert sort.score([good + good], expected, 4, True) == 0.0  # equal is not an improvement


def test_alphabet_sort_strictly_improving_attempts_keep_the_last():
    expected = [["AliceZephyr", "BobYoung", "CarolXu"]]
    worst = "<alphabetical_sorted>\nCarolXu\n</alphabetical_sorted>"
    better = "<alphabetical_sorted>\nAliceZephyr\nCarolXu\n</alphabetical_sorted>"
    best = "<alphabetical_sorted>\nAliceZephyr\nBobYoung\nCarolXu\n</alphabetical_sorted>"
    assert sort.score([worst + better + best], expected, 4, True) == 1.0
    last_alone = sort.turn_similarity(better, expected[0], "alphabetical_sorted")
    assert sort.turn_similarity(worst + better, expected[0], "alphabetical_sorted") == last_alone


def test_alphabet_sort_power_per_turn_on_and_off():
    expected = sort.ground_truths(TURNS[:2], by_first=True)
    replies = [sort.reference_replies(expected)[0], "no tag"]  # similarities 1 and 0
    assert sort.score(replies, expected, 4, True) == 0.5  # mean(1^4, 0^4)
    assert sort.score(replies, expected, 4, False) == 0.5**4  # mean(1, 0)^4


def test_alphabet_sort_similarity_power_sharpens_a_partial_turn():
    expected = [["AliceZephyr", "BobYoung", "CarolXu"]]
    reply = "<alphabetical_sorted>\nAliceZephyr\nCarolXu\n</alphabetical_sorted>"
    sim = sort.turn_similarity(reply, expected[0], "alphabetical_sorted")
    assert sort.score([reply], expected, 1, True) == pytest.approx(sim)
    assert sort.score([reply], expected, 8, True) == pytest.approx(sim**8)
    assert sort.score([reply], expected, 8, False) == pytest.approx(sim**8)  # one turn: the rules agree
