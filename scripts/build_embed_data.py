"""Build the embedding demo's data: questions about sums (the queries) against short passages that state
sums (the corpus), each training row with a hard negative, a passage about a neighbouring sum.

Run `python scripts/build_embed_data.py` (a second). The pairs of numbers come from build_assets.py's split,
so the held-out questions ask about sums the training rows never state. Everything comes from fixed seeds.
"""

import random

from build_assets import ASSETS, QUESTIONS, SEED, split_pairs, write_jsonl

PASSAGES = [
    "The sum of {a} and {b} is {s}.",
    "{a} plus {b} equals {s}.",
    "Adding {a} and {b} gives {s}.",
    "If you add {b} to {a}, you get {s}.",
]
NUM_TRAIN, NUM_EVAL = 2000, 150


def passage(a: int, b: int, rng: random.Random) -> str:
    return rng.choice(PASSAGES).format(a=a, b=b, s=a + b)


def neighbour(a: int, b: int, rng: random.Random) -> tuple[int, int]:
    """A different pair sharing one number with (a, b): the hard negative's."""
    while True:
        other = (a, rng.randrange(100)) if rng.random() < 0.5 else (rng.randrange(100), b)
        if other != (a, b):
            return other


def row(a: int, b: int, rng: random.Random) -> dict:
    query = rng.choice(QUESTIONS).format(a=a, b=b)
    return {"anchor": query, "positive": passage(a, b, rng), "negative": passage(*neighbour(a, b, rng), rng)}


def main():
    seen, held = split_pairs(random.Random(SEED))  # the same split as build_assets.py, from the same seed
    rng = random.Random(SEED + 2)
    train = [row(a, b, rng) for a, b in rng.sample(seen, NUM_TRAIN)]
    evaluation = [row(a, b, rng) for a, b in held[:NUM_EVAL]]
    write_jsonl(ASSETS / "demo" / "embed_train.jsonl", train)
    write_jsonl(ASSETS / "demo" / "embed_eval.jsonl", evaluation)
    print(f"wrote {len(train)} train and {len(evaluation)} held-out rows to {ASSETS / 'demo'}")


if __name__ == "__main__":
    main()
