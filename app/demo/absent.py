"""Statements no generated face meets, drawn from a vocabulary, for the demo reranker to learn to answer "no".

A fixed list of nineteen such statements taught the reranker those nineteen and no more: statements it had never
seen ("a bowl of soup", "striped socks") scored as high as true criteria, so a rubric about something the set
lacks found "matches". The demo checkpoints' tokenizer reads these words almost character by character, so
"striped socks" shares most of its tokens with "dark forehead stripes". So the statements are drawn from objects
and modifiers (thousands of combinations), and a share of them pair a word of the faces' own criteria with
something no face has ("ginger kettle", "crimson fur", "square ears"): to answer "no" the reranker has to read
the whole statement, not spot one familiar word.

The vocabulary shares no word with the statements the quality measurements hold out (:data:`app.demo.trust.ABSENT`),
and no object contains one of their words, so what the floors measure stays unseen (``tests/test_demo_absent.py``
checks it).
"""

from __future__ import annotations

import random

OBJECTS = (
    "anchor", "apple", "balloon", "banana", "barrel", "basket", "battery", "bench", "blanket", "bottle", "bridge",
    "brush", "bucket", "button", "cactus", "camera", "canoe", "castle", "cloud", "coin", "compass", "cookie", "crown",
    "cushion", "desk", "diamond", "drum", "engine", "envelope", "fence", "flag", "fork", "fountain", "garden", "globe",
    "glove", "hammock", "harbor", "helmet", "honey", "island", "jacket", "jar", "kettle", "key", "keyboard", "knife",
    "lemon", "letter", "mailbox", "map", "mirror", "mountain", "mushroom", "necklace", "needle", "ocean", "onion",
    "oven", "padlock", "paddle", "pencil", "piano", "pillow", "pineapple", "pizza", "planet", "plate", "pocket",
    "potato", "puzzle", "pyramid", "radio", "rainbow", "ribbon", "river", "robot", "rocket", "rope", "ruler",
    "sandwich", "scissors", "shell", "shoe", "shovel", "skateboard", "spoon", "stamp", "statue", "suitcase", "sword",
    "table", "telephone", "tent", "ticket", "toaster", "tomato", "towel", "tower", "train", "trophy", "tunnel", "vase",
    "wagon", "wallet", "whistle", "window", "yacht", "zipper", "cheese", "pumpkin", "cabbage", "volcano", "snowman",
    "turtle", "penguin", "elephant", "giraffe", "octopus", "bee", "butterfly", "cup", "saddle", "feather", "ship",
    "airplane", "bus", "motorcycle", "skyscraper", "bakery",
)
# Colours no face's fur or eyes has, and materials: true of no face's fur, eyes, ears or stripes.
FOREIGN = (
    "pink", "violet", "crimson", "neon", "purple", "iron", "steel", "stone", "brick", "rubber", "crystal", "bamboo",
    "tin", "knitted", "leather", "cotton", "inflatable", "square", "frozen", "melted",
)
# Said of objects only.
STATES = (
    "broken", "tiny", "giant", "shiny", "folded", "burning", "floating", "empty", "heavy", "ancient", "modern", "tall",
    "narrow", "wet", "dusty", "electric", "polished", "cracked", "twisted",
)
# The words of the faces' criteria that the mixed statements borrow.
CRITERION_NOUNS = ("fur", "eyes", "ears", "forehead stripes")
CRITERION_MODIFIERS = ("ginger", "grey", "black", "cream", "brown", "green", "amber", "blue", "round", "triangular",
                       "dark")


def absent_statement(rng: random.Random, mixed: float) -> str:
    """One statement no face meets; ``mixed`` is the share that borrow a word of the criteria."""
    if rng.random() < mixed:
        if rng.random() < 0.5:
            return f"{rng.choice(FOREIGN)} {rng.choice(CRITERION_NOUNS)}"
        phrase = f"{rng.choice(CRITERION_MODIFIERS)} {rng.choice(OBJECTS)}"
        return _article(phrase) if rng.random() < 0.5 else phrase
    shape = rng.random()
    if shape < 0.4:
        return _article(rng.choice(OBJECTS))
    phrase = f"{rng.choice(FOREIGN + STATES)} {rng.choice(OBJECTS)}"
    return _article(phrase) if shape < 0.8 else phrase


def _article(phrase: str) -> str:
    return f"{'an' if phrase[0] in 'aeiou' else 'a'} {phrase}"
