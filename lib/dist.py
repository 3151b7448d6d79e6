"""Distributed training: rank and world size from torchrun's environment, the process group, FSDP2 and full state."""

import os
import sys
import threading
import time

# Set by init() when several processes train: the thread that beats for this rank and watches its peers.
_watch: dict = {}


def world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) under a plain `python` launch."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def init(device: str, peer_timeout: float = 120.0) -> str:
    """Joins the process group when torchrun started several processes (nccl on CUDA, gloo on CPU)
    and returns this process's device. From then on every rank beats a heartbeat, and a rank whose
    peer sends none for `peer_timeout` seconds (killed, frozen, cut off) ends with one line."""
    import datetime

    import torch
    import torch.distributed as dist

    _, local_rank, world_size = world()
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if world_size > 1 and not dist.is_initialized():
        # Other ranks wait in a collective while rank 0 starts servers (minutes for vLLM) or waits for a
        # step's rollouts; the 10-minute default would kill them on a slow start or a long episode.
        timeout = datetime.timedelta(hours=2)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timeout)
        _start_heartbeat(peer_timeout)
    return device


def close() -> None:
    """Leaves the process group; every exit path calls it (lib/config.run_main), a failed one too. The
    heartbeat thread is joined first: one still inside a store call while the interpreter shuts down
    aborts the process ("terminate called without an active exception") instead of exiting with its code."""
    if "torch.distributed" not in sys.modules:
        return  # never joined: nothing to leave (and no torch import for a script that needs none)
    import torch.distributed as dist

    if _watch:  # peers stop watching this rank: it may leave before they do
        _watch["stop"].set()
        _watch["thread"].join(timeout=10)
        try:
            _watch["store"].set(f"plainrl/closed/{world()[0]}", "1")
        except Exception:  # rank 0's store is gone: so is every peer that would read this
            pass
        _watch.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def peer_lost(error: BaseException) -> str | None:
    """The one line to end with when `error` is a collective broken by a peer that died (its sockets
    closed: kill -9, a crash), else None."""
    closed = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    if world()[2] == 1 or not isinstance(error, RuntimeError) or not any(m in str(error) for m in closed):
        return None
    return (
        f"error: rank {world()[0]} lost a peer in a collective ({str(error).splitlines()[0][:200]}): "
        "`--resume` on every node continues from the last checkpoint."
    )


def _start_heartbeat(peer_timeout: float) -> None:
    """Rank 0 watches every other rank and they watch rank 0, through counters in torchrun's store.

    A rank legitimately waits in a collective for hours while rank 0 starts vLLM or collects a step's
    rollouts, so the collective timeout cannot tell "busy" from "gone". The beat comes from a thread
    that keeps running while its rank waits or computes (collectives release the GIL); it stops only
    when the whole process stops: kill -9, SIGSTOP, a lost node or network. A peer killed outright
    also breaks the collective's sockets, which usually ends the run sooner.
    """
    import datetime

    import torch.distributed as dist

    rank, _, world_size = world()
    # A client of its own (the default group's is not meant for a second thread); counters, not clock
    # readings, so nodes need no synchronised clocks.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=max(peer_timeout, 10)),
    )
    peers = range(1, world_size) if rank == 0 else [0]
    stop = threading.Event()
    _watch.update(store=store, stop=stop)

    def beat_and_watch() -> None:
        seen = {peer: (-1, time.monotonic()) for peer in peers}
        while not stop.wait(min(2.0, peer_timeout / 5)):
            try:
                store.add(f"plainrl/beat/{rank}", 1)
                for peer in peers:
                    count = store.add(f"plainrl/beat/{peer}", 0)
                    if count != seen[peer][0]:
                        seen[peer] = (count, time.monotonic())
                    elif store.check([f"plainrl/closed/{peer}"]):
                        seen[peer] = (count, time.monotonic())  # finished: it owes no more beats
            except Exception:  # the store lives with node 0's torchrun: gone with it, so is rank 0
                pass
            for peer, (_, last) in seen.items():
                silent = time.monotonic() - last
                if silent > peer_timeout and not stop.is_set():
                    print(
                        f"error: rank {peer} sent no heartbeat for {silent:.0f} s (killed, frozen or "
                        f"unreachable; peer_timeout {peer_timeout:g} s): stopping rank {rank}; "
                        "`--resume` on every node continues from the last checkpoint.",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)  # the main thread may be stuck in a collective that never returns

    _watch["thread"] = threading.Thread(target=beat_and_watch, name="heartbeat", daemon=True)
    _watch["thread"].start()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def all_sum(value: float, device: str) -> float:
    """The sum of a number over all ranks (the number itself in a single process)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return float(value)
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.item()


def all_gather(value) -> list:
    """Every rank's picklable `value`, in rank order."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def shard(model, bf16: bool) -> None:
    """FSDP2: each transformer block, then the rest, sharded across ranks (parameters become DTensors).

    With bf16, parameters are gathered and computed in bfloat16 and gradients reduced in float32,
    while the sharded master weights and the optimizer state stay in float32.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mp_policy": policy} if policy else {}
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    if not block_names and hasattr(model, "get_base_model"):  # peft wraps the transformers model
        block_names = set(model.get_base_model()._no_split_modules or [])
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    assert blocks, f"found no transformer blocks ({block_names}) to shard"
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model, trainable_only: bool = False) -> dict:
    """The unsharded model state on CPU, on rank 0 (other ranks get {}); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(
        model, options=_options(cpu_offload=True, ignore_frozen_params=trainable_only)
    )
    if trainable_only:  # a frozen weight tied to another one (lm_head) still slips through
        trained = {name for name, param in model.named_parameters() if param.requires_grad}
        state = {name: value for name, value in state.items() if name in trained}
    return state


def full_optimizer_state(model, optimizer) -> dict:
    """The unsharded optimizer state keyed by parameter names, on rank 0; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_state(model, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Loads unsharded states read on rank 0 into every rank's shards (other ranks pass {})."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    options = _options(broadcast_from_rank0=dist.is_initialized(), strict=False)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def scatter(shares: list):
    """Rank 0's shares[r] delivered to rank r (shares is ignored on other ranks); shares[0] in one process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return shares[0]
    received = [None]
    dist.scatter_object_list(received, shares if dist.get_rank() == 0 else None, src=0)
    return received[0]
