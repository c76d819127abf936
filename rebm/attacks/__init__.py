"""PGD attacks on the input; they know nothing about processes (pass the unwrapped module)."""

from rebm.attacks.pgd import (
    NORMS,
    OBJECTIVES,
    attack_objective,
    keyed_normal,
    keyed_uniform,
    pgd_attack,
    pgd_from_config,
    random_start,
)

__all__ = [
    "NORMS",
    "OBJECTIVES",
    "attack_objective",
    "keyed_normal",
    "keyed_uniform",
    "pgd_attack",
    "pgd_from_config",
    "random_start",
]
