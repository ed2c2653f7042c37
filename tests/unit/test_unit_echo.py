"""kiln.echo: only the echo that is there is taken off a reply's text (contract §4)."""

from __future__ import annotations

from kiln.echo import MAX_TRACKED_CHOICES, Echoes

PROMPT = "The capital of France is"


def test_an_echo_in_one_piece_is_taken_off_and_the_rest_is_the_models():
    echoes = Echoes([PROMPT])
    assert echoes.own(0, PROMPT + " Paris") == " Paris"
    assert echoes.own(0, PROMPT) == PROMPT  # after the echo, everything is the model's


def test_an_echo_over_several_pieces_is_taken_off_piece_by_piece():
    echoes = Echoes([PROMPT])
    assert [echoes.own(0, piece) for piece in ("The cap", "ital of France", " is Paris", ".")] == ["", "", " Paris", "."]


def test_a_reply_that_leaves_the_echo_gets_back_what_was_held_as_echo():
    echoes = Echoes([PROMPT])
    assert echoes.own(0, "The cap") == ""
    assert echoes.own(0, "tain said") == "The captain said"


def test_a_reply_that_does_not_start_with_the_echo_is_all_the_models():
    echoes = Echoes([PROMPT])  # a server that ignores echo
    assert echoes.own(0, "Paris") == "Paris"
    assert echoes.own(0, PROMPT) == PROMPT


def test_each_choice_has_its_own_echo_and_the_longest_text_it_ends_is_taken():
    echoes = Echoes(["ab", "abc"])
    assert echoes.own(0, "abcd") == "d"
    assert echoes.own(1, "abXY") == "XY"
    assert echoes.own(2, "zz") == "zz"


def test_choices_and_texts_of_a_chunk_or_answer():
    echoes = Echoes([PROMPT])
    answer = {"choices": [{"index": 0, "text": PROMPT + " Paris"}, {"index": 1, "delta": {"content": PROMPT}},
                          {"index": 2, "message": {"role": "assistant", "content": PROMPT + "!"}}, "odd",
                          {"index": 3, "text": 5}]}
    assert echoes.answer(answer)["choices"] == [
        {"index": 0, "text": " Paris"}, {"index": 1, "delta": {"content": ""}},
        {"index": 2, "message": {"role": "assistant", "content": "!"}}, "odd", {"index": 3, "text": 5}]
    assert Echoes([]).answer(answer) is answer


def test_a_stream_of_new_choice_indexes_is_followed_only_so_far():
    echoes = Echoes([PROMPT])
    for index in range(MAX_TRACKED_CHOICES):
        assert echoes.own(index, "The") == ""
    assert echoes.own("another", PROMPT) == PROMPT  # past the bound: all the model's
    assert Echoes([PROMPT]).own([1], PROMPT + "x") == "x"  # an index that is no key: one choice for all such
