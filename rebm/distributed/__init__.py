"""Everything about processes: runtime, collectives, logging, launchers, signals, wrapping.

Rules (docs/design.md §3): the environment decides rank and world size; LOCAL_RANK picks the
device; every rank reaches every collective, and control-flow decisions go through `consensus`.
"""

from rebm.distributed.collectives import (
    CollectiveTimeout,
    RankLost,
    all_gather_cat,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_buffers,
    broadcast_object,
    consensus,
    decide_on_main,
    missing_ranks,
    name_missing_ranks,
    name_stuck_ranks,
    set_collective_timeout,
)
from rebm.distributed.launch import free_port, probe, spawn
from rebm.distributed.logs import print_line, setup_logging
from rebm.distributed.runtime import (
    LaunchError,
    Runtime,
    cap_cpu_threads,
    choose_backend,
    choose_device,
    launch_environment,
    setup_distributed,
    teardown,
)
from rebm.distributed.signals import PreemptionFlag

__all__ = [
    "CollectiveTimeout", "LaunchError", "PreemptionFlag", "Runtime", "all_gather_cat",
    "all_reduce_max", "all_reduce_sum", "barrier", "broadcast_buffers", "broadcast_object",
    "cap_cpu_threads", "choose_backend", "choose_device", "consensus", "decide_on_main",
    "free_port", "launch_environment", "missing_ranks", "name_missing_ranks",
    "name_stuck_ranks", "print_line", "RankLost",
    "probe", "set_collective_timeout", "setup_distributed", "setup_logging", "spawn", "teardown",
]
