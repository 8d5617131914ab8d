"""Generate the small English-like corpus shipped in ``functional_shard/data``.

Nothing can be downloaded when the tests and examples run, so the corpus is
produced from a tiny hand-written grammar instead. The output is fully
determined by ``--seed`` and ``--target-bytes``: rerunning the script with the
defaults reproduces the committed file byte for byte.

The grammar is deliberately narrow (a few hundred words, a dozen sentence
shapes, rhyming verses) so that a character-level model of a few hundred
thousand parameters sees the same spellings and phrase shapes many times and
its loss falls within a few hundred steps.

Usage::

    python tools/make_text.py                      # rewrite the shipped file
    python tools/make_text.py --output /tmp/x.txt  # write somewhere else
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "functional_shard" / "data" / "tiny_tales.txt"

NAMES = [
    "Anna", "Ben", "Clara", "Dan", "Ella", "Finn", "Grace", "Hugo", "Ivy", "Jack",
    "Lily", "Max", "Nora", "Oscar", "Pip", "Rose", "Sam", "Tom", "Una", "Will",
]
CREATURES = [
    "cat", "dog", "fox", "owl", "hen", "frog", "mouse", "bear", "duck", "goat",
    "lamb", "crow", "pig", "cow", "horse", "rabbit", "robin", "bee", "fish", "wolf",
]
ADJECTIVES = [
    "little", "big", "old", "young", "small", "brave", "sleepy", "happy", "quiet", "kind",
    "clever", "silly", "tired", "merry", "gentle", "proud", "shy", "busy", "grumpy", "bright",
]
COLOURS = ["red", "blue", "green", "brown", "white", "black", "grey", "yellow", "golden", "silver"]
PLACES = [
    "the garden", "the wood", "the hill", "the river", "the barn", "the village", "the meadow",
    "the market", "the kitchen", "the pond", "the field", "the town", "the lane", "the shore",
]
THINGS = [
    "a ball", "a cake", "a hat", "a boat", "a kite", "a drum", "a book", "a box", "a cup",
    "a key", "a bell", "a coat", "a basket", "a lamp", "a spoon", "an apple", "an egg",
    "a loaf of bread", "a jar of honey", "a pair of shoes",
]
TIMES = [
    "One morning", "One day", "Later that day", "In the evening", "At night", "Long ago",
    "Before the sun came up", "After the rain", "On a cold day", "On a warm day",
    "When the bell rang", "At noon",
]
INTRANSITIVE = [
    "ran", "sang", "slept", "danced", "laughed", "jumped", "walked", "waited", "smiled",
    "played", "hid", "sat down", "looked up", "went home", "called out",
]
TRANSITIVE = [
    "found", "saw", "took", "lost", "made", "held", "carried", "painted", "wanted", "gave away",
    "dropped", "opened", "hid", "washed", "mended",
]
FEELINGS = ["glad", "sad", "cross", "afraid", "hungry", "cold", "warm", "sleepy", "surprised", "proud"]
SAYINGS = [
    "Where are you going?", "Come and see!", "I am not afraid.", "What a fine day it is.",
    "Can you help me?", "Let us go home.", "Look at the sky!", "I will try again.",
    "That is mine.", "Thank you, my friend.", "It is time for tea.", "Who is there?",
]
# Rhyming pairs for the verses: each pair ends two lines of a couplet.
RHYMES = [
    ("hill", "mill"), ("tree", "sea"), ("bay", "hay"), ("gate", "plate"), ("moon", "dune"),
    ("door", "shore"), ("rain", "lane"), ("stream", "cream"), ("bed", "shed"), ("town", "crown"),
    ("cat", "mat"), ("wall", "hall"), ("star", "car"), ("well", "bell"), ("house", "mouse"),
]
VERSE_OPENINGS = [
    "Over the", "Under the", "Up on the", "Down by the", "Far from the", "Close to the",
]
VERSE_MIDDLES = [
    "the {creature} went walking all through the",
    "the {adjective} {creature} sang to the",
    "we hurried along to the",
    "a {colour} bird flew over the",
    "the children all ran to the",
    "the wind came singing over the",
]


def subject(rng: random.Random) -> str:
    """A sentence subject such as ``"Anna"`` or ``"the sleepy fox"``."""
    if rng.random() < 0.45:
        return rng.choice(NAMES)
    if rng.random() < 0.5:
        return f"the {rng.choice(ADJECTIVES)} {rng.choice(CREATURES)}"
    return f"the {rng.choice(CREATURES)}"


def capitalise(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def sentence(rng: random.Random) -> str:
    """One prose sentence, ending in punctuation."""
    shape = rng.randrange(9)
    who = subject(rng)
    if shape == 0:
        return capitalise(f"{who} {rng.choice(INTRANSITIVE)} in {rng.choice(PLACES)}.")
    if shape == 1:
        return f"{rng.choice(TIMES)}, {who} {rng.choice(TRANSITIVE)} {rng.choice(THINGS)}."
    if shape == 2:
        return capitalise(f"{who} was {rng.choice(FEELINGS)}, so {subject(rng)} {rng.choice(INTRANSITIVE)}.")
    if shape == 3:
        return capitalise(f'{who} said, "{rng.choice(SAYINGS)}"')
    if shape == 4:
        thing = rng.choice(THINGS)
        return capitalise(f"{who} {rng.choice(TRANSITIVE)} {thing} and took it to {rng.choice(PLACES)}.")
    if shape == 5:
        # Only one-word things take a colour ("a red kite", not "a red pair of shoes").
        noun = rng.choice([thing for thing in THINGS if len(thing.split()) == 2]).split()[-1]
        return capitalise(f"the {rng.choice(CREATURES)} had a {rng.choice(COLOURS)} {noun}.")
    if shape == 6:
        return capitalise(f"{who} and {subject(rng)} {rng.choice(INTRANSITIVE)} together.")
    if shape == 7:
        return capitalise(f"when {who} {rng.choice(INTRANSITIVE)}, {subject(rng)} was {rng.choice(FEELINGS)}.")
    return capitalise(f"{who} {rng.choice(INTRANSITIVE)} and {rng.choice(INTRANSITIVE)} until night came.")


def paragraph(rng: random.Random) -> str:
    """A short story paragraph of four to seven sentences."""
    return " ".join(sentence(rng) for _ in range(rng.randint(4, 7)))


def verse(rng: random.Random) -> str:
    """A four-line rhyming verse: two couplets from :data:`RHYMES`."""
    lines = []
    for first, second in rng.sample(RHYMES, 2):
        middle = rng.choice(VERSE_MIDDLES).format(
            creature=rng.choice(CREATURES), adjective=rng.choice(ADJECTIVES), colour=rng.choice(COLOURS)
        )
        lines.append(f"{rng.choice(VERSE_OPENINGS)} {first},")
        lines.append(f"{capitalise(middle)} {second}.")
    return "\n".join(lines)


def make_text(seed: int, target_bytes: int) -> str:
    """Stories and verses separated by blank lines, about ``target_bytes`` long (ASCII)."""
    rng = random.Random(seed)
    pieces: list[str] = []
    size = 0
    while size < target_bytes:
        piece = verse(rng) if rng.random() < 0.2 else paragraph(rng)
        pieces.append(piece)
        size += len(piece) + 2
    return "\n\n".join(pieces) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=20240607)
    parser.add_argument("--target-bytes", type=int, default=200_000)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    text = make_text(args.seed, args.target_bytes)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" keeps the file identical on every platform.
    args.output.write_text(text, encoding="ascii", newline="\n")
    print(f"wrote {len(text.encode('ascii'))} bytes to {args.output}")


if __name__ == "__main__":
    main()
