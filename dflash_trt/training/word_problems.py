"""Synthetic grade-school maths word problems: training prompts for self-distillation.

The packages this project can install ship no maths word problems except evaluation sets
(GSM8K's test split), and ShareGPT holds about a hundred. These templates are our own (written
for this project, not derived from any evaluation question): shopping, rates, ages, fractions,
percentages, time, distance, savings, sharing. Names, items and numbers are drawn from a seeded
generator, so a seed gives the same prompts on every machine. Only the prompts matter: the
answers come from the target itself (``dflash-trt distill --prompts-file``), so the drafter
learns the target's own step-by-step arithmetic style. Every prompt is checked against the
evaluation sets with the same 13-gram test as the ShareGPT prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..errors import DFlashError
from ..prompts import _contaminated

_NAMES = [
    "Maya",
    "Liam",
    "Sofia",
    "Noah",
    "Aria",
    "Ethan",
    "Zara",
    "Lucas",
    "Nina",
    "Omar",
    "Priya",
    "Diego",
    "Hana",
    "Felix",
    "Leila",
    "Marco",
    "Ines",
    "Tariq",
    "Grace",
    "Ravi",
    "Elena",
    "Samuel",
    "Yuki",
    "Chloe",
    "Mateo",
    "Amara",
    "Jonas",
    "Ruth",
    "Kofi",
    "Mira",
    "Oscar",
    "Lena",
    "Hugo",
    "Asha",
    "Pablo",
    "Ivy",
]
_ITEMS = (
    ("notebook", "notebooks"),
    ("apple", "apples"),
    ("pencil", "pencils"),
    ("cupcake", "cupcakes"),
    ("ticket", "tickets"),
    ("book", "books"),
    ("plant", "plants"),
    ("sticker", "stickers"),
    ("shirt", "shirts"),
    ("jar of honey", "jars of honey"),
    ("bag of rice", "bags of rice"),
    ("toy car", "toy cars"),
)
_PLACES = ("the market", "the bakery", "a garage sale", "the bookstore", "the school fair", "the farm stand")
_JOBS = ("walking dogs", "tutoring", "mowing lawns", "babysitting", "washing cars", "delivering newspapers")


def _pick(rng: random.Random, seq, k: int = 1):
    return rng.sample(list(seq), k) if k > 1 else rng.choice(seq)


def _shopping(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    (a, a_pl), (b, b_pl) = _pick(r, _ITEMS, 2)
    qa, qb, pa, pb = r.randint(2, 9), r.randint(2, 6), r.randint(2, 15), r.randint(3, 25)
    paid = (qa * pa + qb * pb) // 10 * 10 + r.choice((10, 20, 50))
    return (
        f"{n} buys {qa} {a_pl} for ${pa} each and {qb} {b_pl} for ${pb} each at {_pick(r, _PLACES)}. "
        f"{n} pays with ${paid}. How much change does {n} get back?"
    )


def _rate_job(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    rate, hours, days, goal = r.randint(8, 25), r.randint(2, 6), r.randint(2, 5), r.randint(3, 12) * 100
    return (
        f"{n} earns ${rate} an hour {_pick(r, _JOBS)}. {n} works {hours} hours a day, {days} days a week, "
        f"and wants to save ${goal} for a new bike. How many weeks will it take?"
    )


def _ages(r: random.Random) -> str:
    a, b, c = _pick(r, _NAMES, 3)
    age, k, d = r.randint(4, 15), r.randint(2, 4), r.randint(2, 9)
    return (
        f"{a} is {age} years old. {b} is {k} times as old as {a}, and {c} is {d} years younger than {b}. "
        f"What is the sum of their ages?"
    )


def _fraction(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    _, pl = _pick(r, _ITEMS)
    den = r.choice((3, 4, 5, 6, 8))
    total = den * r.randint(4, 20)
    num, give = r.randint(1, den - 1), r.randint(1, 5)
    return (
        f"{n} had {total} {pl}. {n} gave {num}/{den} of them to a friend and then sold {give} more. "
        f"How many {pl} does {n} have left?"
    )


def _percent(r: random.Random) -> str:
    _, pl = _pick(r, _ITEMS)
    price, off, tax = r.randint(4, 60) * 5, r.choice((10, 15, 20, 25, 30, 40)), r.choice((5, 8, 10))
    qty = r.randint(2, 5)
    return (
        f"A store sells {pl} for ${price} each. This week they are {off}% off, and a {tax}% sales tax is "
        f"added to the discounted price. How much do {qty} {pl} cost in total?"
    )


def _distance(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    s1, t1, s2, t2 = r.randint(30, 70), r.randint(1, 4), r.randint(40, 80), r.randint(1, 3)
    return (
        f"{n} drives at {s1} miles per hour for {t1} hours, then at {s2} miles per hour for {t2} hours. "
        f"How far does {n} drive in total, and what is the average speed for the whole trip?"
    )


def _sharing(r: random.Random) -> str:
    names = _pick(r, _NAMES, r.randint(3, 5))
    _, pl = _pick(r, _ITEMS)
    each, extra = r.randint(3, 12), r.randint(1, 4)
    boxes = r.randint(2, 6)
    return (
        f"{', '.join(names[:-1])} and {names[-1]} share {boxes} boxes of {pl}. Each box holds "
        f"{each * len(names) + extra} {pl}. If they share them equally, how many does each person get, "
        f"and how many are left over?"
    )


def _time(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    tasks = r.randint(3, 5)
    mins = [r.randint(10, 55) for _ in range(tasks)]
    start = r.randint(7, 10)
    parts = ", ".join(f"{m} minutes" for m in mins[:-1]) + f" and {mins[-1]} minutes"
    return (
        f"{n} starts homework at {start}:00. The {tasks} subjects take {parts}, with a 10-minute break "
        f"between subjects. At what time does {n} finish?"
    )


def _savings(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    start, weekly, spend, weeks = r.randint(10, 90), r.randint(5, 30), r.randint(5, 40), r.randint(4, 12)
    return (
        f"{n} has ${start} in a piggy bank and adds ${weekly} every week. Every {r.randint(2, 4)} weeks "
        f"{n} spends ${spend} on a game. How much money does {n} have after {weeks} weeks?"
    )


def _farm(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    chickens, cows, eggs, price = r.randint(5, 40), r.randint(2, 12), r.randint(3, 6), r.randint(2, 6)
    return (
        f"{n}'s farm has {chickens} chickens and {cows} cows. Each chicken lays {eggs} eggs a week and "
        f"{n} sells eggs for ${price} a dozen. How many legs are on the farm, and how much does {n} "
        f"earn from eggs in {r.randint(2, 8)} weeks?"
    )


def _recipe(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    serves, want = r.choice((4, 6, 8)), r.choice((12, 18, 24, 30))
    flour, sugar, eggs = r.randint(2, 4), r.choice((1, 2, 3)), r.randint(2, 4)
    return (
        f"A recipe for {serves} people uses {flour} cups of flour, {sugar} cups of sugar and {eggs} eggs. "
        f"{n} is cooking for {want} people. How much of each ingredient does {n} need?"
    )


def _area(r: random.Random) -> str:
    n = _pick(r, _NAMES)
    w, h, cost = r.randint(8, 30), r.randint(6, 25), r.randint(2, 9)
    return (
        f"{n}'s garden is a rectangle {w} feet long and {h} feet wide. Fencing costs ${cost} per foot and "
        f"grass seed covers 50 square feet per bag. How much does the fence cost, and how many bags of "
        f"seed are needed?"
    )


def _collection(r: random.Random) -> str:
    a, b = _pick(r, _NAMES, 2)
    _, pl = _pick(r, _ITEMS)
    x, more, k = r.randint(10, 60), r.randint(5, 25), r.randint(2, 3)
    return (
        f"{a} has {x} {pl}. {b} has {more} more than {a}. Then {a} buys {k} times as many as {a} already "
        f"has. How many {pl} do they have together now?"
    )


def _tickets(r: random.Random) -> str:
    adult, child, na, nc = r.randint(8, 20), r.randint(3, 9), r.randint(1, 4), r.randint(1, 5)
    parking = r.randint(5, 15)
    return (
        f"Museum tickets cost ${adult} for adults and ${child} for children. A family of {na} adults and "
        f"{nc} children visits, and parking costs ${parking}. They pay with a $100 bill. How much change "
        f"do they get?"
    )


def _work_rate(r: random.Random) -> str:
    a, b = _pick(r, _NAMES, 2)
    pa, pb, total = r.randint(10, 30), r.randint(10, 30), r.randint(6, 20) * 10
    return (
        f"{a} can paint {pa} fence boards an hour and {b} can paint {pb}. Working together, how long will "
        f"it take them to paint {total} boards?"
    )


_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping,
    _rate_job,
    _ages,
    _fraction,
    _percent,
    _distance,
    _sharing,
    _time,
    _savings,
    _farm,
    _recipe,
    _area,
    _collection,
    _tickets,
    _work_rate,
)


def word_problems(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct synthetic word problems, templates in turn, seeded.

    Args:
        n: how many prompts (>= 1).
        seed: the generator's seed (the same seed gives the same prompts).

    Returns:
        Prompt texts (no chat template), none of which shares a 13-word sequence with an
        evaluation prompt (:data:`dflash_trt.prompts.DATASETS`).

    Raises:
        DFlashError: ``n`` < 1, or the templates cannot yield ``n`` distinct prompts.
    """
    if n < 1:
        raise DFlashError(f"number of prompts must be >= 1, got {n}")
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    for i in range(50 * n):
        text = _TEMPLATES[i % len(_TEMPLATES)](rng)
        if text not in seen and not _contaminated(text):
            seen.add(text)
            out.append(text)
            if len(out) == n:
                return out
    raise DFlashError(f"the word-problem templates gave only {len(out)} distinct prompts, asked for {n}")
