"""The code env's problems: a signature, a statement, hidden cases, and a reference solution.

Results are JSON values (ints, strings, lists, bools) so the host can compare them exactly.
The reference solutions are for tests (a correct attempt must score 1.0); agents never see
them, nor the cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    id: str
    function: str
    signature: str
    statement: str
    cases: tuple[tuple[tuple[Any, ...], Any], ...]  # (args, expected)
    reference: str


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        id="fizzbuzz",
        function="fizzbuzz",
        signature="def fizzbuzz(n: int) -> list[str]",
        statement="Return the FizzBuzz strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for "
        "multiples of 5, 'FizzBuzz' for both, otherwise the number as a string.",
        cases=(
            ((1,), ["1"]),
            ((3,), ["1", "2", "Fizz"]),
            ((5,), ["1", "2", "Fizz", "4", "Buzz"]),
            ((0,), []),
            (
                (15,),
                [
                    "1",
                    "2",
                    "Fizz",
                    "4",
                    "Buzz",
                    "Fizz",
                    "7",
                    "8",
                    "Fizz",
                    "Buzz",
                    "11",
                    "Fizz",
                    "13",
                    "14",
                    "FizzBuzz",
                ],
            ),
        ),
        reference="def fizzbuzz(n):\n"
        "    out = []\n"
        "    for i in range(1, n + 1):\n"
        "        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
        "        out.append(s or str(i))\n"
        "    return out\n",
    ),
    Problem(
        id="palindrome",
        function="is_palindrome",
        signature="def is_palindrome(text: str) -> bool",
        statement="Return True if text reads the same forwards and backwards, ignoring case "
        "and every character that is not a letter or a digit.",
        cases=(
            (("A man, a plan, a canal: Panama",), True),
            (("race a car",), False),
            (("",), True),
            (("No 'x' in Nixon",), True),
            (("ab",), False),
            (("12321",), True),
        ),
        reference="def is_palindrome(text):\n"
        "    s = [c.lower() for c in text if c.isalnum()]\n"
        "    return s == s[::-1]\n",
    ),
    Problem(
        id="rle",
        function="run_length",
        signature="def run_length(text: str) -> str",
        statement="Run-length encode text: each run of one character becomes the count then "
        "the character, e.g. 'aaab' -> '3a1b'.",
        cases=(
            (("aaab",), "3a1b"),
            (("",), ""),
            (("abc",), "1a1b1c"),
            (("zzzzzzzzzzzz",), "12z"),
            (("aabbaa",), "2a2b2a"),
        ),
        reference="def run_length(text):\n"
        "    out, i = [], 0\n"
        "    while i < len(text):\n"
        "        j = i\n"
        "        while j < len(text) and text[j] == text[i]:\n"
        "            j += 1\n"
        "        out.append(f'{j - i}{text[i]}')\n"
        "        i = j\n"
        "    return ''.join(out)\n",
    ),
    Problem(
        id="two-sum",
        function="two_sum",
        signature="def two_sum(nums: list[int], target: int) -> list[int]",
        statement="Return the indices [i, j] with i < j of the first pair (smallest j, then "
        "smallest i) whose values add up to target, or [] if there is none.",
        cases=(
            (([2, 7, 11, 15], 9), [0, 1]),
            (([3, 2, 4], 6), [1, 2]),
            (([1, 2, 3], 7), []),
            (([5, 5, 5], 10), [0, 1]),
            (([], 0), []),
            (([-1, 4, 2, 1], 0), [0, 3]),
        ),
        reference="def two_sum(nums, target):\n"
        "    seen = {}\n"
        "    for j, v in enumerate(nums):\n"
        "        if target - v in seen:\n"
        "            return [seen[target - v], j]\n"
        "        seen.setdefault(v, j)\n"
        "    return []\n",
    ),
    Problem(
        id="roman",
        function="to_roman",
        signature="def to_roman(n: int) -> str",
        statement="Return n (1 to 3999) in Roman numerals, e.g. 1994 -> 'MCMXCIV'.",
        cases=(
            ((1,), "I"),
            ((4,), "IV"),
            ((9,), "IX"),
            ((58,), "LVIII"),
            ((1994,), "MCMXCIV"),
            ((3999,), "MMMCMXCIX"),
        ),
        reference="def to_roman(n):\n"
        "    table = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'),\n"
        "             (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'),\n"
        "             (4, 'IV'), (1, 'I')]\n"
        "    out = ''\n"
        "    for value, sym in table:\n"
        "        while n >= value:\n"
        "            out += sym\n"
        "            n -= value\n"
        "    return out\n",
    ),
    Problem(
        id="flatten",
        function="flatten",
        signature="def flatten(items: list) -> list",
        statement="Flatten arbitrarily nested lists into one list of the non-list values, "
        "in order.",
        cases=(
            (([1, [2, [3, 4]], 5],), [1, 2, 3, 4, 5]),
            (([],), []),
            (([[[]]],), []),
            ((["a", ["b"], [["c"]]],), ["a", "b", "c"]),
            (([1, 2, 3],), [1, 2, 3]),
        ),
        reference="def flatten(items):\n"
        "    out = []\n"
        "    for x in items:\n"
        "        out.extend(flatten(x) if isinstance(x, list) else [x])\n"
        "    return out\n",
    ),
    Problem(
        id="word-count",
        function="top_words",
        signature="def top_words(text: str, k: int) -> list[list]",
        statement="Count the words of text (lowercased, split on anything that is not a letter) "
        "and return the k most frequent as [word, count] pairs, by count descending then word "
        "ascending.",
        cases=(
            (("the cat and the hat", 2), [["the", 2], ["and", 1]]),
            (("", 3), []),
            (("B a b A c", 5), [["a", 2], ["b", 2], ["c", 1]]),
            (("one, two; two! three three three", 1), [["three", 3]]),
        ),
        reference="import re\n"
        "from collections import Counter\n"
        "def top_words(text, k):\n"
        "    counts = Counter(re.findall('[a-z]+', text.lower()))\n"
        "    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))\n"
        "    return [[w, c] for w, c in ranked[:k]]\n",
    ),
    Problem(
        id="primes",
        function="primes_below",
        signature="def primes_below(n: int) -> list[int]",
        statement="Return every prime number smaller than n, ascending.",
        cases=(
            ((10,), [2, 3, 5, 7]),
            ((2,), []),
            ((0,), []),
            ((30,), [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]),
            ((3,), [2]),
        ),
        reference="def primes_below(n):\n"
        "    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n",
    ),
)


# ---------------------------------------------------------------------------- easy level
# One-line functions, each stated in words the answer follows closely ("x times 5" is
# `x * 5`). EASY_EXAMPLE is the prior exchange's problem and is never asked.

_NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight",
            9: "nine"}  # fmt: skip
_XS = (0, 1, 4, -3, 10)


def _arith(op: str, verb: str, n: int) -> Problem:
    name = f"{op}_{_NUMBERS[n]}"
    expr = {"add": f"x + {n}", "times": f"x * {n}", "minus": f"x - {n}"}[op]
    value = {"add": lambda x: x + n, "times": lambda x: x * n, "minus": lambda x: x - n}[op]
    return Problem(
        id=f"easy-{name}",
        function=name,
        signature=f"def {name}(x)",
        statement=f"returns x {verb} {n}",
        cases=tuple(((x,), value(x)) for x in _XS),
        reference=f"def {name}(x): return {expr}\n",
    )


def _one_liner(name: str, arg: str, statement: str, body: str, args: tuple[Any, ...],
               value: Any) -> Problem:  # fmt: skip
    return Problem(
        id=f"easy-{name}",
        function=name,
        signature=f"def {name}({arg})",
        statement=statement,
        cases=tuple(((a,), value(a)) for a in args),
        reference=f"def {name}({arg}): return {body}\n",
    )


_LISTS: tuple[Any, ...] = ([3, 1, 2], [5], [-1, 7, 7, 0], [2, 9])
_WORDS: tuple[Any, ...] = ("abc", "Hello", "racecar", "x y")

EASY_EXAMPLE = _arith("add", "plus", 2)
EASY_PROBLEMS: tuple[Problem, ...] = (
    *(_arith("add", "plus", n) for n in range(3, 10)),
    *(_arith("times", "times", n) for n in range(2, 10)),
    *(_arith("minus", "minus", n) for n in range(2, 10)),
    _one_liner("square", "x", "returns x times x", "x * x", _XS, lambda x: x * x),
    _one_liner("negate", "x", "returns minus x", "-x", _XS, lambda x: -x),
    _one_liner("first", "items", "returns the first item of the list items", "items[0]",
               _LISTS, lambda v: v[0]),
    _one_liner("last", "items", "returns the last item of the list items", "items[-1]",
               _LISTS, lambda v: v[-1]),
    _one_liner("total", "items", "returns the sum of the list items", "sum(items)", _LISTS,
               sum),
    _one_liner("largest", "items", "returns the largest item of the list items", "max(items)",
               _LISTS, max),
    _one_liner("smallest", "items", "returns the smallest item of the list items",
               "min(items)", _LISTS, min),
    _one_liner("count", "items", "returns the number of items in the list items", "len(items)",
               _LISTS, len),
    _one_liner("shout", "text", "returns text in upper case", "text.upper()", _WORDS,
               str.upper),
    _one_liner("whisper", "text", "returns text in lower case", "text.lower()", _WORDS,
               str.lower),
    _one_liner("backwards", "text", "returns text reversed", "text[::-1]", _WORDS,
               lambda t: t[::-1]),
)  # fmt: skip
