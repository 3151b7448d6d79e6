"""The builtin engine's side of an in-memory weight transfer (vLLM 0.32's routes, lib/inference/weights/transfer.py the trainer's):
it joins the trainer's group and receives every weight broadcast from rank 0 into the engine."""

import threading

import torch

from lib.config import UserError
from lib.inference.weights import group


class Receiver:
    """The group this engine is a member of (one at a time); a failed or timed-out transfer leaves it, so the
    trainer's next init forms a new one."""

    def __init__(self, engine):
        self.engine, self.group, self.timeout_s = engine, None, group.TIMEOUT_S
        self.backend, self.updating = "gloo", False
        self._lock = threading.Lock()

    def init(self, info: dict) -> None:
        """Joins at info's master_address:master_port as rank rank_offset (this engine is one worker)."""
        missing = {"master_address", "master_port", "rank_offset", "world_size"} - info.keys()
        if missing:
            raise UserError(f"init_info lacks {sorted(missing)}.")
        self.shutdown()
        self.timeout_s = float(info.get("timeout_s", group.TIMEOUT_S))
        self.backend = info.get("backend", "gloo")
        if self.backend not in ("gloo", "nccl"):
            raise UserError(f"init_info backend must be gloo or nccl, not {self.backend!r}.")
        self.group = group.join(
            info["master_address"], int(info["master_port"]), rank=int(info["rank_offset"]),
            world_size=int(info["world_size"]), backend=self.backend, timeout_s=self.timeout_s,
        )  # fmt: skip

    def start(self) -> None:
        if self.group is None:
            raise UserError(f"{group.NO_GROUP}: POST /init_weight_transfer_engine first.")
        if self.updating:
            raise UserError("start_weight_update called while a weight update is already active.")
        self.updating = True

    def update(self, info: dict) -> int:
        """Receives the weights info names (dtype_names, shapes) in order and swaps them in between two decode
        steps; returns the number received. Names and shapes are checked before anything is received."""
        if not self.updating:
            raise UserError("start_weight_update must be called before update_weights.")
        names, dtypes, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
        if not (len(names) == len(dtypes) == len(shapes)):
            raise UserError("update_info's names, dtype_names and shapes must have the same length.")
        state = self.engine.model.state_dict()
        for name, shape in zip(names, shapes):
            if name not in state or tuple(state[name].shape) != tuple(shape):
                raise UserError(f"update_info's {name} {shape} does not fit the served model.")
        device = self.engine.device if self.backend == "nccl" else "cpu"
        tensors = {}
        with self._lock:
            try:
                for name, dtype, shape in zip(names, dtypes, shapes):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                    group.broadcast(self.group, tensor, self.timeout_s)
                    tensors[name] = tensor
            except RuntimeError as error:  # the trainer died, froze or left: this group is done
                self.updating, self.group = False, None
                raise UserError(f"the weight transfer failed after {len(tensors)} weights: {error}") from None
        self.engine.load_tensors(tensors)
        return len(tensors)

    def finish(self) -> None:
        if not self.updating:
            raise UserError("finish_weight_update called without a matching start_weight_update.")
        self.updating = False

    def shutdown(self) -> None:
        self.group, self.updating = None, False
