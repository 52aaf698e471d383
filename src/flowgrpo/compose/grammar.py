"""The compositional prompt grammar: GenEval's categories in miniature, over coloured blobs.

Objects are soft discs on a plain dark-grey background; what tells them apart is their colour and,
in ``attribution`` prompts, their size. Every prompt of the grammar is one of (examples)::

    single       a red blob
    two_object   a red blob and a blue blob
    counting     one red blob | two red blobs | three red blobs | four red blobs
    position     a red blob on the left | on the right | at the top | at the bottom
    relation     a red blob to the left of a blue blob | to the right of | above | below
    attribution  a big red blob and a small blue blob | a small red blob and a big blue blob

A prompt parses into a typed spec (frozen dataclasses, one per category) and back:
``prompt_of(parse(p)) == p`` for every canonical prompt and ``parse(prompt_of(s)) == s`` for
every spec (tested over all of them). :func:`parse` reads words case-insensitively and
separated by any whitespace; anything else is refused with one line naming the prompt and
the first word it could not read. Two-blob prompts name two different colours (a relation
between two red blobs would not say which is which). Pure Python: data preparation needs
this module and nothing heavier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

Colour = Literal["red", "yellow", "green", "cyan", "blue", "purple", "white"]
Size = Literal["big", "small"]
Side = Literal["left", "right", "top", "bottom"]
Direction = Literal["left of", "right of", "above", "below"]  # where the first blob is, from the second
Category = Literal["single", "two_object", "counting", "position", "relation", "attribution"]

COLOURS: tuple[Colour, ...] = get_args(Colour)
SIZES: tuple[Size, ...] = get_args(Size)
SIDES: tuple[Side, ...] = get_args(Side)
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)
CATEGORIES: tuple[Category, ...] = get_args(Category)
COUNTS = (1, 2, 3, 4)

NOUN, NOUN_PLURAL = "blob", "blobs"
ARTICLE = "a"  # no colour or size word starts with a vowel
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
SIDE_PHRASES: dict[Side, str] = {
    "left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"
}  # fmt: skip
DIRECTION_PHRASES: dict[Direction, str] = {
    "left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"
}  # fmt: skip
# the longest prompt of the grammar has 43 characters; what parse reads at all is bounded
MAX_PROMPT_CHARS = 200


class PromptError(ValueError):
    """A text outside the grammar (or a spec outside it); the message names the prompt and the
    word it could not read. ``reason`` is the message without the prompt (for reports that show
    the prompt apart)."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Blob:
    """One blob a prompt names: its colour, and its size in attribution prompts only."""

    colour: Colour
    size: Size | None = None


@dataclass(frozen=True)
class Single:
    category: ClassVar[Category] = "single"
    colour: Colour


@dataclass(frozen=True)
class TwoObjects:
    category: ClassVar[Category] = "two_object"
    first: Colour
    second: Colour


@dataclass(frozen=True)
class Counting:
    category: ClassVar[Category] = "counting"
    colour: Colour
    count: int  # exactly this many blobs of the colour


@dataclass(frozen=True)
class Position:
    category: ClassVar[Category] = "position"
    colour: Colour
    side: Side  # the blob's centre lies in this half of the image


@dataclass(frozen=True)
class Relation:
    category: ClassVar[Category] = "relation"
    first: Colour
    direction: Direction  # the first blob is <direction> the second
    second: Colour


@dataclass(frozen=True)
class Attribution:
    category: ClassVar[Category] = "attribution"
    first: Blob  # both sized, the sizes differ: one big, one small
    second: Blob


Spec = Single | TwoObjects | Counting | Position | Relation | Attribution


def check_spec(spec: Spec) -> Spec:
    """``spec`` when it is one of the grammar's; a :class:`PromptError` saying why not otherwise."""
    colours = [b.colour for b in blobs_of(spec)]
    unknown = [c for c in colours if c not in COLOURS]
    if unknown:
        raise PromptError(str(spec), f"unknown colour {unknown[0]!r} (colours: {', '.join(COLOURS)})")
    if isinstance(spec, Counting) and spec.count not in COUNTS:
        raise PromptError(str(spec), f"count {spec.count} is outside {COUNTS[0]}..{COUNTS[-1]}")
    if isinstance(spec, TwoObjects | Relation | Attribution) and colours[0] == colours[1]:
        raise PromptError(str(spec), "a two-blob prompt names two different colours")
    if isinstance(spec, Position) and spec.side not in SIDES:
        raise PromptError(str(spec), f"unknown side {spec.side!r}")
    if isinstance(spec, Relation) and spec.direction not in DIRECTIONS:
        raise PromptError(str(spec), f"unknown direction {spec.direction!r}")
    if isinstance(spec, Attribution) and {spec.first.size, spec.second.size} != set(SIZES):
        raise PromptError(str(spec), "an attribution prompt names one big and one small blob")
    return spec


def blobs_of(spec: Spec) -> tuple[Blob, ...]:
    """The blobs the prompt asks for, each once (a counting prompt: ``count`` times)."""
    if isinstance(spec, Single | Position):
        return (Blob(spec.colour),)
    if isinstance(spec, Counting):
        return (Blob(spec.colour),) * spec.count
    if isinstance(spec, TwoObjects | Relation):
        return Blob(spec.first), Blob(spec.second)
    return spec.first, spec.second


def prompt_of(spec: Spec) -> str:
    """The canonical prompt of ``spec`` (lower case, single spaces)."""
    check_spec(spec)
    if isinstance(spec, Single):
        return _phrase(Blob(spec.colour))
    if isinstance(spec, TwoObjects):
        return f"{_phrase(Blob(spec.first))} and {_phrase(Blob(spec.second))}"
    if isinstance(spec, Counting):
        noun = NOUN if spec.count == 1 else NOUN_PLURAL
        return f"{NUMBER_WORDS[spec.count]} {spec.colour} {noun}"
    if isinstance(spec, Position):
        return f"{_phrase(Blob(spec.colour))} {SIDE_PHRASES[spec.side]}"
    if isinstance(spec, Relation):
        return f"{_phrase(Blob(spec.first))} {DIRECTION_PHRASES[spec.direction]} {_phrase(Blob(spec.second))}"
    return f"{_phrase(spec.first)} and {_phrase(spec.second)}"


def _phrase(blob: Blob) -> str:
    size = f"{blob.size} " if blob.size else ""
    return f"{ARTICLE} {size}{blob.colour} {NOUN}"


def all_specs() -> tuple[Spec, ...]:
    """Every spec of the grammar, category by category, in a fixed order."""
    pairs = [(a, b) for a in COLOURS for b in COLOURS if a != b]
    specs: list[Spec] = [Single(c) for c in COLOURS]
    specs += [TwoObjects(a, b) for a, b in pairs]
    specs += [Counting(c, n) for c in COLOURS for n in COUNTS]
    specs += [Position(c, s) for c in COLOURS for s in SIDES]
    specs += [Relation(a, d, b) for a, b in pairs for d in DIRECTIONS]
    specs += [Attribution(Blob(a, s), Blob(b, t)) for a, b in pairs for s, t in (SIZES, SIZES[::-1])]
    return tuple(specs)


# --- parsing -----------------------------------------------------------------------------------


class _Words:
    """The prompt's words and a cursor over them; errors name the word at the cursor."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.words = prompt.lower().split()
        self.at = 0

    def peek(self) -> str | None:
        return self.words[self.at] if self.at < len(self.words) else None

    def take(self, choices: tuple[str, ...], expected: str) -> str:
        word = self.peek()
        if word not in choices:
            raise self.error(f"expected {expected}")
        self.at += 1
        return word

    def take_phrase(self, phrase: str) -> None:
        for word in phrase.split():
            self.take((word,), repr(phrase))

    def end(self) -> None:
        if self.peek() is not None:
            raise self.error("expected the end of the prompt")

    def error(self, why: str, at: int | None = None) -> PromptError:
        at = self.at if at is None else at
        word = repr(self.words[at]) if at < len(self.words) else "(the end)"
        return PromptError(f"cannot read prompt {_shown(self.prompt)}", f"word {at + 1}, {word}: {why}")


def parse(prompt: str) -> Spec:
    """The spec of a prompt of the grammar; :class:`PromptError` for anything else."""
    if not isinstance(prompt, str):
        raise PromptError("cannot read a prompt", f"a prompt is a string, got {type(prompt).__name__}")
    if len(prompt) > MAX_PROMPT_CHARS:
        reason = f"{len(prompt)} characters, more than {MAX_PROMPT_CHARS}"
        raise PromptError(f"cannot read prompt {_shown(prompt)}", reason)
    words = _Words(prompt)
    if words.peek() in NUMBER_WORDS.values():
        return _counting(words)
    first, size_at = _blob(words)
    follows = words.peek()
    if follows == "and":
        return _two_blobs(words, first, size_at)
    if size_at is not None:
        raise words.error("a size is used only for two blobs joined by 'and'", size_at)
    if follows is None:
        return Single(first.colour)
    if follows in ("on", "at"):
        side = _side(words)
        words.end()
        return Position(first.colour, side)
    direction = _direction(words)
    second, second_size_at = _blob(words)
    if second_size_at is not None:
        raise words.error("a size is used only for two blobs joined by 'and'", second_size_at)
    words.end()
    return _checked(words, Relation(first.colour, direction, second.colour))


def _counting(words: _Words) -> Counting:
    number = words.take(tuple(NUMBER_WORDS.values()), "a number")
    count = next(n for n, w in NUMBER_WORDS.items() if w == number)
    colour = words.take(COLOURS, f"a colour ({', '.join(COLOURS)})")
    words.take((NOUN if count == 1 else NOUN_PLURAL,), repr(NOUN if count == 1 else NOUN_PLURAL))
    words.end()
    return Counting(_colour(colour), count)


def _blob(words: _Words) -> tuple[Blob, int | None]:
    """``a [size] colour blob`` -> the blob and the index of its size word (None without one)."""
    words.take((ARTICLE,), f"{ARTICLE!r} or a number ({', '.join(NUMBER_WORDS.values())})")
    size_at = words.at if words.peek() in SIZES else None
    size = words.take(SIZES, "") if size_at is not None else None
    expected = f"{'a colour' if size else 'a size or a colour'} ({', '.join(COLOURS)})"
    colour = _colour(words.take(COLOURS, expected))
    words.take((NOUN,), repr(NOUN))
    return Blob(colour, None if size is None else _size(size)), size_at


def _two_blobs(words: _Words, first: Blob, first_size_at: int | None) -> Spec:
    words.take(("and",), "'and'")
    second_at = words.at + 1
    second, second_size_at = _blob(words)
    words.end()
    if (first_size_at is None) != (second_size_at is None):
        at = second_at if first_size_at is not None else second_size_at
        raise words.error("give both blobs a size (big, small) or neither", at)
    if first.size is None:
        return _checked(words, TwoObjects(first.colour, second.colour))
    if first.size == second.size:
        raise words.error("one blob is big and the other small", second_size_at)
    return _checked(words, Attribution(first, second))


def _side(words: _Words) -> Side:
    preposition = words.take(("on", "at"), "'on' or 'at'")
    words.take(("the",), "'the'")
    choices = ("left", "right") if preposition == "on" else ("top", "bottom")
    side = words.take(choices, " or ".join(repr(c) for c in choices))
    return next(s for s in SIDES if s == side)


def _direction(words: _Words) -> Direction:
    expected = "'and', 'on the', 'at the', 'to the left of', 'to the right of', 'above' or 'below'"
    word = words.take(("to", "above", "below"), expected)
    if word == "above":
        return "above"
    if word == "below":
        return "below"
    words.take(("the",), "'the'")
    side = words.take(("left", "right"), "'left' or 'right'")
    words.take(("of",), "'of'")
    return "left of" if side == "left" else "right of"


def _checked(words: _Words, spec: Spec) -> Spec:
    try:
        return check_spec(spec)
    except PromptError:
        raise words.error("the two blobs need different colours", len(words.words) - 2) from None


def _colour(word: str) -> Colour:
    return next(c for c in COLOURS if c == word)


def _size(word: str) -> Size:
    return next(s for s in SIZES if s == word)


def _shown(prompt: str, most: int = 80) -> str:
    return repr(prompt if len(prompt) <= most else prompt[: most - 3] + "...")
