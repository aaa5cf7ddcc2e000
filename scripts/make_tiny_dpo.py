"""Write the embedded preference set: short questions answered in two styles, one chosen and one rejected.

    python scripts/make_tiny_dpo.py [--out assets/tiny_dpo.jsonl]

Every record asks a short question (a capital, a sum or product, a color, an animal, an opposite). The chosen answer
is always one short, correct sentence that restates the question ("The capital of Peru is Lima."); the rejected
one always dodges it ("I do not know.", or a dodge with a wrong guess: "I do not know, maybe Quito."). A tiny model
tuned with DPO on part of them learns to prefer the first style on the held-out rest.

Most records are conversations (``{"prompt": [user], "chosen": [assistant], "rejected": [assistant]}``); a few are in
TRL's other formats, so the file exercises them all: the standard one (strings), and the implicit prompt (chosen and
rejected whole conversations, or whole strings, sharing the question). Plain ASCII; the seed is fixed, so two runs
write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
N_STANDARD = 4           # {"prompt": str, "chosen": str, "rejected": str}
N_IMPLICIT_CHAT = 4      # {"chosen": [user, assistant], "rejected": [user, assistant]}
N_IMPLICIT_TEXT = 2      # {"chosen": "Question: ... Answer: ...", "rejected": "Question: ... Answer: ..."}

CAPITALS = (
    ("Peru", "Lima"), ("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Russia", "Moscow"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
    ("Ecuador", "Quito"), ("Germany", "Berlin"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Morocco", "Rabat"),
    ("Colombia", "Bogota"), ("Australia", "Canberra"), ("Nigeria", "Abuja"),
)
COLORS = (  # (the thing, as a sentence starts with it, its color)
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"), ("coal", "black"),
    ("a tomato", "red"), ("a carrot", "orange"), ("a lemon", "yellow"), ("milk", "white"), ("a strawberry", "red"),
    ("a frog", "green"), ("chocolate", "brown"), ("a crow", "black"), ("a plum", "purple"), ("a lime", "green"),
    ("the sea", "blue"), ("a cherry", "red"), ("an eggplant", "purple"), ("a pumpkin", "orange"), ("ink", "black"),
    ("a cloud", "white"), ("a leaf", "green"),
)
SOUNDS = (
    ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"), ("pig", "oink"),
    ("lion", "roar"), ("owl", "hoot"), ("horse", "neigh"), ("frog", "croak"), ("snake", "hiss"), ("bee", "buzz"),
)
LEGS = (
    ("spider", "eight"), ("dog", "four"), ("bird", "two"), ("ant", "six"), ("cat", "four"), ("chicken", "two"),
    ("horse", "four"), ("beetle", "six"), ("duck", "two"), ("goat", "four"),
)
BABIES = (
    ("cow", "calf"), ("dog", "puppy"), ("cat", "kitten"), ("sheep", "lamb"), ("horse", "foal"), ("duck", "duckling"),
    ("frog", "tadpole"), ("lion", "cub"), ("goat", "kid"), ("kangaroo", "joey"),
)
OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"), ("happy", "sad"),
    ("open", "closed"), ("light", "dark"), ("old", "new"), ("wet", "dry"), ("early", "late"), ("full", "empty"),
    ("hard", "soft"), ("loud", "quiet"), ("rich", "poor"), ("tall", "short"), ("thick", "thin"), ("win", "lose"),
    ("push", "pull"), ("first", "last"),
)
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def questions(rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, the chosen answer, a wrong answer to guess) for every item of every set."""
    items = []

    def wrong(right: str, pool) -> str:
        return rng.choice([x for x in pool if x != right])

    capitals = [c for _, c in CAPITALS]
    for country, capital in CAPITALS:
        items.append((f"What is the capital of {country}?", f"The capital of {country} is {capital}.",
                      wrong(capital, capitals)))
    colors = sorted({c for _, c in COLORS})
    for thing, color in COLORS:
        items.append((f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {color}.", wrong(color, colors)))
    sounds = [s for _, s in SOUNDS]
    for animal, sound in SOUNDS:
        items.append((f"What sound does {article(animal)} make?", f"{article(animal).capitalize()} says {sound}.",
                      wrong(sound, sounds)))
    for animal, legs in LEGS:
        items.append((f"How many legs does {article(animal)} have?", f"{article(animal).capitalize()} has {legs} legs.",
                      wrong(legs, NUMBER_WORDS[1:])))
    babies = [b for _, b in BABIES]
    for animal, baby in BABIES:
        items.append((f"What is a baby {animal} called?", f"A baby {animal} is called a {baby}.", wrong(baby, babies)))
    sums = sorted(rng.sample([(a, b) for a in range(1, 10) for b in range(1, 10)], 30))
    for a, b in sums:
        items.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", str(a + b + rng.choice((-2, -1, 1, 2, 3)))))
    products = sorted(rng.sample([(a, b) for a in range(2, 10) for b in range(2, 10)], 20))
    for a, b in products:
        items.append((f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", str(a * b + rng.choice((-3, -1, 1, 2, 4)))))
    words = [w for pair in OPPOSITES for w in pair]
    for word, opposite in OPPOSITES:
        items.append((f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}.",
                      wrong(opposite, [w for w in words if w != word])))
    return items


def dodge(rng: random.Random, guess: str) -> str:
    """The rejected style: the question dodged, sometimes with a wrong guess."""
    return rng.choice(("I do not know.", f"I do not know, maybe {guess}.", f"No idea. Maybe {guess}?"))


def make_records(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    items = questions(rng)
    rng.shuffle(items)
    records = []
    for n, (question, answer, guess) in enumerate(items):
        rejected = dodge(rng, guess)
        user = {"role": "user", "content": question}
        if n < N_STANDARD:
            records.append({"prompt": question, "chosen": " " + answer, "rejected": " " + rejected})
        elif n < N_STANDARD + N_IMPLICIT_CHAT:
            records.append({"chosen": [user, {"role": "assistant", "content": answer}],
                            "rejected": [user, {"role": "assistant", "content": rejected}]})
        elif n < N_STANDARD + N_IMPLICIT_CHAT + N_IMPLICIT_TEXT:
            records.append({"chosen": f"Question: {question} Answer: {answer}",
                            "rejected": f"Question: {question} Answer: {rejected}"})
        else:
            records.append({"prompt": [user], "chosen": [{"role": "assistant", "content": answer}],
                            "rejected": [{"role": "assistant", "content": rejected}]})
    rng.shuffle(records)  # the other formats anywhere in the file
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "tiny_dpo.jsonl")
    args = parser.parse_args(argv)
    records = make_records()
    text = "".join(json.dumps(record) + "\n" for record in records)
    assert text.isascii()
    args.out.write_text(text, encoding="ascii")
    print(f"{args.out}: {len(records)} preference pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
