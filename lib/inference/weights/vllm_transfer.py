"""plainrl's gloo weight-transfer engine for vLLM (`--weight-transfer-config '{"backend": "plainrl_gloo"}'`): vLLM
0.32 has none for CPUs (its nccl engine's broadcast does nothing on the CPU build), so the trainer's broadcast
(lib/inference/weights/transfer.py) reaches each worker over gloo, loaded as vLLM's own engines load checkpoint-format weights.

Its registration also keeps vLLM's TCP stores on loopback when their host is (loopback_stores). Imported
only inside vLLM's processes: by its `vllm.general_plugins` entry point (pyproject.toml), and, so that a
checkout that is not installed registers it too, by lib/inference/vllm.py as it starts vLLM's command line
and by lib/inference/weights/vllm_worker.py when vLLM loads the worker extension."""

import dataclasses
import functools

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from lib.inference.weights import group

NAME = "plainrl_gloo"


@dataclasses.dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = group.TIMEOUT_S


@dataclasses.dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """A worker's member of the trainer's gloo group; a failed or timed-out broadcast leaves it, so the
    trainer's next init forms a new one. Ranks as vLLM's nccl engine lays them out (nccl_common.py)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group, self.timeout_s = None, group.TIMEOUT_S

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if init_info.backend != "gloo":
            raise ValueError(f"{NAME} broadcasts over gloo only, not {init_info.backend!r}")
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.timeout_s, self.group = init_info.timeout_s, None
        self.group = group.join(
            init_info.master_address, init_info.master_port, rank=rank, world_size=init_info.world_size,
            backend="gloo", timeout_s=self.timeout_s,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if (
            self.group is None
        ):  # a restarted server: the trainer forms the group again (lib/inference/weights/transfer.py)
            raise RuntimeError(f"{NAME}: {group.NO_GROUP}; POST /init_weight_transfer_engine first")
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{NAME}: no group; POST /init_weight_transfer_engine first")
        received = 0
        try:
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                group.broadcast(self.group, weight, self.timeout_s)
                self.model.load_weights([(name, weight.to(self.device))])
                received += 1
        except RuntimeError as error:  # the trainer died, froze or left: this group is done
            self.group = None
            raise RuntimeError(
                f"{NAME}: the weight transfer failed after {received} weights: {error}"
            ) from None

    def shutdown(self) -> None:
        self.group = None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM's trainer-side entry: broadcasts each (name, tensor) over trainer_args["group"] (lib/inference/weights/group.py)."""
        for _, tensor in iterator:
            group.broadcast(
                trainer_args["group"], tensor.cpu(), trainer_args.get("timeout_s", group.TIMEOUT_S)
            )


def loopback_stores(create_tcp_store):
    """vLLM's create_tcp_store, whose server listens on the host it is given alone when that is loopback.
    vLLM's data-parallel head makes its coordination and world-group stores on data_parallel_master_ip
    (127.0.0.1 unless told otherwise) with no socket of its own, and torch's TCPStore then listens on every
    interface: a store anyone on the network could write to."""

    @functools.wraps(create_tcp_store)
    def create(host: str, port: int, listen_socket=None, **kwargs):
        if listen_socket is None and kwargs.get("is_master") and group.is_loopback(host):
            listen_socket = group.listening_socket(host, port)
            port = listen_socket.getsockname()[1]  # port 0 asks for a free one; the store must be told which
        return create_tcp_store(host, port, listen_socket=listen_socket, **kwargs)

    create.loopback = True
    return create


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM runs it in each of its processes (once is enough). It
    registers the engine, and keeps vLLM's TCP stores on loopback when their host is (loopback_stores)."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.distributed.utils as distributed_utils
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            NAME, "lib.inference.weights.vllm_transfer", "GlooWeightTransferEngine"
        )
    if not getattr(distributed_utils.create_tcp_store, "loopback", False):
        # parallel_state imported the function by name when it loaded, before any plugin ran.
        patched = loopback_stores(distributed_utils.create_tcp_store)
        distributed_utils.create_tcp_store = parallel_state.create_tcp_store = patched
