"""The group an in-memory weight transfer runs over: the trainer's rank 0 and every server's engines, formed
outside torch's default group (gloo on CPUs, NCCL on GPUs), with collectives that fail after a timeout."""

import datetime

# A collective that has not completed within this long fails on every side, and a server tears its group
# down: neither a dead trainer nor a dead server leaves the other waiting forever. The controller learns of a
# dead or frozen server sooner, from its /health (lib/reload.py post).
TIMEOUT_S = 300.0


def join(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = TIMEOUT_S):
    """This process's member of a group of `world_size` formed at host:port (rank 0 listens there); its
    collectives fail after `timeout_s`. backend: gloo or nccl."""
    import torch.distributed as td

    timeout = datetime.timedelta(seconds=timeout_s)
    store = td.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "gloo":
        return td.ProcessGroupGloo(store, rank, world_size, timeout)
    assert backend == "nccl", f"unknown backend {backend!r}"
    options = td.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return td.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast(group, tensor, timeout_s: float = TIMEOUT_S) -> None:
    """Sends (rank 0) or receives (every other rank) `tensor` in place; an error past `timeout_s`."""
    group.broadcast(tensor, 0, datetime.timedelta(seconds=timeout_s)).wait()
