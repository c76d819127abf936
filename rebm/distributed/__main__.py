"""`torchrun --nproc_per_node=N -m rebm.distributed`: the rendezvous probe."""

from rebm.distributed.launch import probe

probe()
