"""A reply's echo of its request (vLLM's `echo`), told from what the model wrote (contract §4).

With `echo`, each completion starts with its prompt (with `max_tokens: 0` it is only that:
lm-eval scores a text so), and a chat reply with the last message. Those characters are the
request's, billed as its prompt; counted as the reply's, they would be billed again as
completion. Only an echo that is there is taken off: each choice's text, as it comes, is matched
against the texts the request may have echoed, and from the first character that matches none,
the text is the model's (a choice that starts otherwise, a server that ignores `echo`: all of
it). Text the gateway cannot know, such as a prompt of token ids written back as text, is never
taken off the text: each choice that comes with such a prompt has its prompt's ids taken off
its own counts instead, at most what that choice's texts count (`unseen_floor`, `unseen_count`).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from .metering import LONGEST_TOKEN, TOKEN_BYTES, estimate_text_tokens, fewest_tokens

__all__ = ["MAX_TRACKED_CHOICES", "Echoes"]

# Choices whose echo is followed; past that many (a hostile stream of indexes), every further
# choice's text is all the model's.
MAX_TRACKED_CHOICES = 10_000

_OVER = None  # a choice whose echo is over (taken off, or never there)


class Echoes:
    """The texts a request's replies may start with, and where each choice stands in them."""

    def __init__(self, texts: Sequence[Any], *, per_prompt: int | None = None, ids: Sequence[int] = ()) -> None:
        """`texts`: what every choice may echo; with `per_prompt` (a batch of prompts, `n`
        choices each), each prompt is echoed by its own choices only: choice i by prompt
        i // n, as vLLM orders them. A prompt that is no text (token ids) echoes nothing the
        gateway can know: `ids`, the token ids of each prompt (of the one prompt every choice
        echoes, without `per_prompt`). Each choice is matched against its own few texts, so the
        matching costs time linear in the reply, however many prompts a batch holds."""
        self._texts = tuple(text if isinstance(text, str) else "" for text in texts)
        self._every = tuple(index for index, text in enumerate(self._texts) if text)
        self._per_prompt = per_prompt
        self._ids = tuple(ids)
        # choice index → (the texts it may still be echoing, how far into them), or _OVER
        self._choices: dict[Hashable, tuple[tuple[int, ...], int] | None] = {}
        # choice index → [its prompt's ids, the fewest tokens and the count of its texts so far]
        self._unseen: dict[Hashable, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._every) or any(self._ids)

    @property
    def longest_bytes(self) -> int:
        """The most bytes one reply may repeat: the longest text, in UTF-8, or a prompt of token
        ids as text of LONGEST_TOKEN bytes a token at most (what each is, the gateway cannot know)."""
        return max(max((len(text.encode()) for text in self._texts), default=0),
                   max(self._ids, default=0) * LONGEST_TOKEN)

    @property
    def unseen_floor(self) -> int:
        """What the choices' texts may hold of prompts of token ids, against their fewest tokens."""
        return sum(min(ids, fewest) for ids, fewest, _ in self._unseen.values())

    @property
    def unseen_count(self) -> int:
        """The same, against the count of their tokens."""
        return sum(min(ids, count) for ids, _, count in self._unseen.values())

    def _note_unseen(self, key: Hashable, text: str) -> None:
        """A piece of a choice whose prompt is token ids: what it counts, for that choice alone."""
        noted = self._unseen.get(key)
        if noted is None:
            if self._per_prompt is None:
                prompt = 0
            elif type(key) is int and key >= 0:
                prompt = key // self._per_prompt
            else:
                return
            if prompt >= len(self._ids) or not self._ids[prompt] or len(self._unseen) >= MAX_TRACKED_CHOICES:
                return
            noted = self._unseen[key] = [self._ids[prompt], 0, 0]
        if text:
            noted[1] += fewest_tokens(text)
            noted[2] += 1 if len(text) <= TOKEN_BYTES else estimate_text_tokens(text)

    def _candidates(self, key: Hashable) -> tuple[int, ...]:
        if self._per_prompt is None:
            return self._every
        if type(key) is not int or key < 0:
            return ()
        index = key // self._per_prompt
        return (index,) if index < len(self._texts) and self._texts[index] else ()

    def own(self, choice: Any, text: str) -> str:
        """Of the next piece of this choice's text, what the model wrote (all of it, once the
        echo is over). A piece within the echo is nothing of the model's; should a later piece
        leave every echoed text, the pieces held as echo are given back as the model's."""
        key = choice if isinstance(choice, (int, str)) and not isinstance(choice, bool) else None
        if self._ids:
            self._note_unseen(key, text)
        state = self._choices.get(key, ())
        if state is _OVER:
            return text
        if state == ():
            if len(self._choices) >= MAX_TRACKED_CHOICES:
                return text
            state = (self._candidates(key), 0)
            if not state[0]:
                self._choices[key] = _OVER
                return text
        candidates, offset = state
        ended = None
        going = []
        for index in candidates:
            echoed = self._texts[index]
            rest = len(echoed) - offset
            if len(text) >= rest:
                if text.startswith(echoed[offset:]) and (ended is None or rest > ended):
                    ended = rest  # the longest echo that ends within this piece
            elif echoed.startswith(text, offset):
                going.append(index)
        if ended is not None:
            self._choices[key] = _OVER
            return text[ended:]
        if going:
            self._choices[key] = (tuple(going), offset + len(text))
            return ""
        self._choices[key] = _OVER
        held = self._texts[candidates[0]][:offset]  # matched so far: the model's after all
        return held + text

    def choice(self, choice: Any) -> Any:
        """A completion's or chat reply's choice (or its stream chunk's) with what it echoes taken
        off the text that echoes it (a completion's `text`, a reply's content); anything else as is."""
        if not isinstance(choice, dict):
            return choice
        index = choice.get("index")
        if isinstance(choice.get("text"), str):
            return {**choice, "text": self.own(index, choice["text"])}
        for field in ("delta", "message"):
            part = choice.get(field)
            if isinstance(part, dict) and isinstance(part.get("content"), str):
                return {**choice, field: {**part, "content": self.own(index, part["content"])}}
        return choice

    def answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A buffered answer (or a stream's chunk) with each choice's echo taken off."""
        choices = answer.get("choices")
        if not self or not isinstance(choices, list):
            return answer
        return {**answer, "choices": [self.choice(choice) for choice in choices]}
