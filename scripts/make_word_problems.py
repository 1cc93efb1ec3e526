"""Write data/word_problems.jsonl: short addition and subtraction word problems (seeded).

    .venv/bin/python scripts/make_word_problems.py [--rows 400] [--seed 0] [--out PATH]

Each row is `{"question": ..., "answer": N, "kind": "add" | "sub"}` with operands 1-9 (a
difference is never negative): small enough that SmolLM2-135M on a CPU can learn them in
minutes (recipes/word-problems.yaml). The same seed writes the same file byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kim", "Leo")
ITEMS = ("apples", "books", "coins", "cups", "eggs", "pens", "shells", "stamps", "toys")
ADD = (
    "{name} has {a} {items}. {name} gets {b} more. How many {items} does {name} have now?",
    "There are {a} {items} in a box and {b} {items} on a table. How many {items} are there in all?",
    "{name} found {a} {items} on Monday and {b} {items} on Tuesday. How many {items} did {name} find?",
)
SUB = (
    "{name} has {a} {items} and gives away {b}. How many {items} does {name} have left?",
    "There were {a} {items} on a shelf. {b} of them were taken. How many {items} are on the shelf now?",
    "{name} had {a} {items} and lost {b}. How many {items} does {name} have now?",
)


def make_rows(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    seen: set[str] = set()
    while len(rows) < n:
        kind = rng.choice(("add", "sub"))
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if kind == "sub":
            a, b = max(a, b), min(a, b)
        template = rng.choice(ADD if kind == "add" else SUB)
        question = template.format(name=rng.choice(NAMES), items=rng.choice(ITEMS), a=a, b=b)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": a + b if kind == "add" else a - b,
                     "kind": kind})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("data/word_problems.jsonl"))
    args = parser.parse_args()
    rows = make_rows(args.rows, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
