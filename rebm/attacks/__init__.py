"""PGD attacks on the input; they know nothing about processes (pass the unwrapped module)."""

from rebm.attacks.fused import pgd_attack_streams
from rebm.attacks.pgd import (
    NORMS,
    OBJECTIVES,
    AttackStream,
    attack_objective,
    keyed_normal,
    keyed_uniform,
    pgd_attack,
    pgd_attack_stream,
    pgd_from_config,
    random_start,
    stream_from_config,
)

__all__ = [
    "NORMS",
    "OBJECTIVES",
    "AttackStream",
    "attack_objective",
    "keyed_normal",
    "keyed_uniform",
    "pgd_attack",
    "pgd_attack_stream",
    "pgd_attack_streams",
    "pgd_from_config",
    "random_start",
    "stream_from_config",
]
