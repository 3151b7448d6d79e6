"""The group an in-memory weight transfer runs over: the trainer's rank 0 and every server's engines, formed
outside torch's default group (gloo on CPUs, NCCL on GPUs), with collectives that fail after a timeout."""

import datetime
import ipaddress
import socket

# A collective that has not completed within this long fails on every side, and a server tears its group
# down: neither a dead trainer nor a dead server leaves the other waiting forever. The controller learns of a
# dead or frozen server sooner, from its /health (lib/inference/weights/reload.py post).
TIMEOUT_S = 300.0
# What a server without a group answers /start_weight_update (lib/inference/server/transfer.py, lib/inference/weights/vllm_transfer.py): one
# restarted since the group formed, which lib/inference/weights/transfer.py forms again.
NO_GROUP = "no weight transfer group"


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback: localhost, 127.0.0.0/8 or ::1."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening at host:port alone (port 0: a free one), for a TCPStore's server to take over: torch's
    own listens on every interface, whatever host it is given (torch 2.13)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def join(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = TIMEOUT_S):
    """This process's member of a group of `world_size` formed at host:port (rank 0 listens there, on that
    address alone when it is loopback); its collectives fail after `timeout_s`. backend: gloo or nccl."""
    import torch.distributed as td

    timeout = datetime.timedelta(seconds=timeout_s)
    # Neither the store nor gloo checks who connects, and the store alone would listen on every interface
    # for the whole run: with every member on this machine's loopback, both listen there alone.
    loopback, listener = is_loopback(host), None
    if rank == 0 and loopback:
        listener = listening_socket(host, port).detach()  # the store closes it
    store = td.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, master_listen_fd=listener
    )
    if backend == "gloo" and loopback:
        options = td.ProcessGroupGloo._Options()
        options._timeout, options._devices = timeout, [td.ProcessGroupGloo.create_device(hostname=host)]
        return td.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "gloo":
        return td.ProcessGroupGloo(store, rank, world_size, timeout)
    assert backend == "nccl", f"unknown backend {backend!r}"
    options = td.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return td.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast(group, tensor, timeout_s: float = TIMEOUT_S) -> None:
    """Sends (rank 0) or receives (every other rank) `tensor` in place; an error past `timeout_s`."""
    group.broadcast(tensor, 0, datetime.timedelta(seconds=timeout_s)).wait()
