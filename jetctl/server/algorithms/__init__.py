"""RL algorithms, one file each, behind one small protocol (`base.Algorithm`).

    from jetctl.server import algorithms
    algorithms.names()              # what train.algorithm accepts
    alg = algorithms.make(train)    # train: the recipe's TrainConfig (its algorithm and
                                    # hyperparameters)
    alg.advantages(rewards)         # one group's rewards -> one advantage per rollout
    alg.loss(new, old, adv, seq_index, totals)  -> (loss, LossStats)

The names are the recipe's `AlgorithmName` (jetctl/recipe/schema.py: a new algorithm adds its
file here and its name there). This module imports nothing heavy; each algorithm's module
is imported when it is made. They share data types (base.py), not classes.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, get_args

from jetctl.recipe.schema import AlgorithmName

if TYPE_CHECKING:
    from jetctl.recipe import TrainConfig
    from jetctl.server.algorithms.base import Algorithm


def names() -> tuple[str, ...]:
    """Every algorithm `train.algorithm` accepts, each the name of its module here."""
    return get_args(AlgorithmName)


def make(train: TrainConfig) -> Algorithm:
    """The algorithm `train.algorithm` with the recipe's hyperparameters."""
    name = train.algorithm
    if name not in names():
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown algorithm {name!r}: choose one of {', '.join(names())}{hint}")
    module = importlib.import_module(f"{__name__}.{name}")
    algorithm: Algorithm = module.from_config(train)
    return algorithm
