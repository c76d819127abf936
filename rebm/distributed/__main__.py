"""`torchrun --nproc_per_node=N -m rebm.distributed`: the rendezvous probe."""

import argparse

parser = argparse.ArgumentParser(
    prog="torchrun --nproc_per_node=N -m rebm.distributed",
    description="Join the process group, run one all_reduce and print each rank's device and "
                "backend: tests the launcher, the network and the backend alone "
                "(docs/distributed.md).")
parser.parse_args()

from rebm.distributed.launch import probe  # noqa: E402  (after --help, which needs no torch)

probe()
