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


def test_each_choice_of_a_batch_is_matched_against_its_own_prompt():
    """vLLM's choices of a batch come prompt by prompt, n each (choice i: prompt i // n)."""
    echoes = Echoes(["first prompt", [1, 2], "third prompt"], per_prompt=2)
    assert echoes.own(0, "first prompt A") == " A" and echoes.own(1, "first prompt B") == " B"
    assert echoes.own(2, "first prompt C") == "first prompt C"  # token ids: nothing the gateway can know
    assert echoes.own(4, "third prompt D") == " D"
    assert echoes.own(3, "third prompt E") == "third prompt E"  # another prompt's text is the model's
    assert echoes.own(6, "first prompt F") == "first prompt F"  # past the batch: no prompt of its own
    assert echoes.own("0", "first prompt G") == "first prompt G"


class _Counted(str):
    """A text that counts the comparisons made with it."""

    compared = 0

    def startswith(self, *args):
        _Counted.compared += 1
        return super().startswith(*args)


def test_matching_a_large_batch_compares_each_piece_with_a_few_texts_only():
    """A batch of 10 000 prompts echoed by its 10 000 choices was matched choice by choice
    against every prompt: 10^8 comparisons, 21 s with the event loop held (and one piece of a
    stream against 20 000 equal prompts rebuilt its list of them one by one)."""
    prompts = [_Counted(f"prompt number {i}") for i in range(10_000)]
    echoes = Echoes(prompts, per_prompt=1)
    _Counted.compared = 0
    answer = {"choices": [{"index": i, "text": _Counted(f"prompt number {i} tok")} for i in range(10_000)]}
    assert all(choice["text"] == " tok" for choice in echoes.answer(answer)["choices"])
    assert _Counted.compared <= 2 * 10_000
    same = Echoes([_Counted("same prompt text")] * 20_000, per_prompt=1)
    _Counted.compared = 0
    for piece in "same prompt text!":
        same.own(0, _Counted(piece))
    assert _Counted.compared <= 2 * len("same prompt text!")


def test_a_batch_read_with_n_as_the_model_server_reads_it():
    """n of "2" or 2.0 is 2 choices a prompt to vLLM: choice 3 echoes the second prompt."""
    from kiln.apis.completions import API as COMPLETIONS

    for n in (2, "2", 2.0, " 2 "):
        echoes = COMPLETIONS.echoes({"prompt": ["Hello there", "World wide"], "n": n, "echo": True})
        assert [echoes.own(i, text) for i, text in enumerate(["Hello there!", "Hello there?", "World wide.",
                                                               "World wide,"])] == ["!", "?", ".", ","], n
