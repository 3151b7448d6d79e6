"""In-memory weight sync: the trainer's rank 0 broadcasts each step's weights into every server's engines over a
torch.distributed group (gloo on CPUs, NCCL on GPUs), driven over vLLM 0.32's weight-transfer routes, then checks
them as a reload is checked (lib/inference/weights/reload.py: fingerprint, label, fresh KV). Both engines take the same routes."""

import re
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

from lib.config import UserError
from lib.endpoint import check_servers, headers, model_card, root_url, ssl_context
from lib.inference.weights import fingerprint, group, reload

# The name plainrl's gloo engine answers to, in vLLM (lib/inference/weights/vllm_transfer.py) and in the builtin engine; "nccl"
# is vLLM's own engine, for GPUs.
GLOO = "plainrl_gloo"


def rendezvous_address(urls: list[str]) -> str:
    """Where the servers at `urls` reach rank 0: loopback when every one is on this machine's loopback (the
    group then listens there alone, lib/inference/weights/group.py), else this machine's address on the route to one that is not."""
    elsewhere = [url for url in urls if not group.is_loopback(urlsplit(url).hostname or "")]
    if not elsewhere:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
        # A datagram socket sends nothing on connect: it only picks the route.
        route.connect((urlsplit(elsewhere[0]).hostname, 9))
        return route.getsockname()[0]


def sender(config, urls: list[str], api_key: str | None, device: str, say=print) -> "Sender | None":
    """Rank 0's Sender for a run whose inference.weight_sync is memory (config: InferenceConfig), else None."""
    from lib.inference.launch import transfer_backend

    if config.weight_sync != "memory" or not urls:
        return None
    return Sender(urls, api_key, device, transfer_backend(config, device), say)


def step_tensors(model, dtype) -> dict:
    """{weight name: tensor in `dtype`} as the servers take them, on rank 0 ({} elsewhere; every rank calls
    it: under FSDP gathering the weights is collective): copies, so training on does not change what is in
    flight; the tied output layer left out (it is the embedding, sent once), as weights/step_N holds them."""
    from lib import dist
    from lib.trainer.servable import lora_scales, merge_lora

    state = dist.full_model_state(model)
    if dist.world()[0] != 0:
        return {}
    state = merge_lora(state, lora_scales(model))  # inference.lora_sync merged: the plain model's names
    tensors = {name: value.detach().to(dtype=dtype, copy=True).contiguous() for name, value in state.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def written_fingerprints(tensors: dict, tied: bool) -> dict[str, list[float]]:
    """The fingerprints a server must compute with after receiving `tensors` (fingerprint.of_directory's)."""
    written = {name: fingerprint.of_tensor(tensor) for name, tensor in tensors.items()}
    if tied and "model.embed_tokens.weight" in written:
        written["lm_head.weight"] = written["model.embed_tokens.weight"]
    return written


def brief(error: BaseException) -> str:
    """A collective's error in one sentence: gloo's and NCCL's start with a source location and go on."""
    text = re.sub(r"^\[[^\]]*\] ", "", str(error).strip())
    return text.split(". ")[0].splitlines()[0]


def concurrently(calls: list) -> None:
    """Runs every call in a daemon thread of its own and re-raises the first error, once all have returned or
    one has failed: a server that failed must not wait behind one stuck in a collective."""
    errors, threads = [], []

    def run(call):
        try:
            call()
        except BaseException as error:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(error)

    for call in calls:
        threads.append(threading.Thread(target=run, args=(call,), daemon=True))
        threads[-1].start()
    while any(thread.is_alive() for thread in threads) and not errors:
        time.sleep(0.05)
    if errors:
        raise errors[0]


class Sender:
    """Rank 0's side: the group with every server's engines (formed by connect(), again after a failure) and
    send() of one step's weights. The builtin engine and vLLM started with plainrl's engine (`vllm_backend`
    plainrl_gloo) join a torch.distributed group (gloo; NCCL where the trainer and a builtin engine are on
    GPUs); vLLM's own `nccl` engine joins vLLM's NCCL communicator (GPUs only: vLLM 0.32's CPU build fails
    to join; an engine that moved nothing, as vLLM #57022 reports of it, meets the fingerprint)."""

    def __init__(self, urls: list[str], api_key: str | None, device: str, vllm_backend: str, say=print):
        self.urls, self.api_key, self.vllm_backend, self.say = urls, api_key, vllm_backend, say
        self.device = "cuda" if device.startswith("cuda") else "cpu"
        self.group, self.timeout_s, self.vllm_nccl = None, group.TIMEOUT_S, False

    def connect(self) -> None:
        """Forms the group: rank 0 here, then each server's engines from its rank_offset on (vLLM's layout:
        an engine's rank is its data parallel rank x engines per replica + its rank within + rank_offset)."""
        from lib.inference.launch import free_port

        builtin = [model_card(url, self.api_key).get("owned_by") == "plainrl" for url in self.urls]
        sizes = [self._call(url, "GET", "/get_world_size").get("world_size", 1) for url in self.urls]
        vllm_nccl = self.vllm_backend == "nccl" and not all(builtin)
        if vllm_nccl and any(builtin):
            raise UserError("an in-memory sync over vLLM's nccl engine cannot include builtin engines.")
        world_size, port = 1 + sum(sizes), free_port()
        host, offsets = rendezvous_address(self.urls), [1 + sum(sizes[:i]) for i in range(len(sizes))]
        transport = "nccl" if self.device == "cuda" else "gloo"

        def init(url: str, offset: int) -> None:
            info = {
                "master_address": host,
                "master_port": port,
                "rank_offset": offset,
                "world_size": world_size,
            }
            if not vllm_nccl:
                info |= {"backend": transport, "timeout_s": self.timeout_s}
            self._call(url, "POST", "/init_weight_transfer_engine", {"init_info": info})

        def join() -> None:
            if vllm_nccl:  # vLLM's rendezvous and communicator, as its own trainer engine opens them
                from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

                self.group = stateless_init_process_group(host, port, 0, world_size, self.device)
            else:
                self.group = group.join(
                    host, port, rank=0, world_size=world_size, backend=transport, timeout_s=self.timeout_s
                )

        self.vllm_nccl = vllm_nccl
        inits = [lambda url=url, offset=offset: init(url, offset) for url, offset in zip(self.urls, offsets)]
        try:
            concurrently([join, *inits])
        except Exception as error:
            self.group = None
            if isinstance(error, ValueError) and vllm_nccl and self.device == "cpu":
                # vLLM 0.32's CPU build: its nccl engine asks torch for an accelerator when it joins, and fails.
                raise UserError(
                    f"{error}; vLLM's nccl weight-transfer engine needs GPUs: on CPUs start vLLM with "
                    "--vllm.weight-transfer-backend plainrl_gloo and pass --inference.vllm-transfer-backend "
                    "plainrl_gloo"
                ) from None
            if isinstance(error, ValueError):
                raise
            raise UserError(
                f"the weight-transfer group with the inference servers did not form: {error}"
            ) from None

    def send(self, tensors: dict) -> None:
        """Broadcasts `tensors` ({name: tensor}) to every engine while each server receives them in its
        /update_weights; a server that fails, dies or freezes ends this in one sentence naming it."""
        if self.group is None:
            self.connect()
        info = {
            "names": list(tensors),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
        }
        if restarted := self._start():
            # A server restarted since the group formed holds none: the group forms again, as at the start,
            # and this sync goes on (the fingerprint after it checks the new server as any other).
            servers = f"server{'s' if len(restarted) > 1 else ''} {', '.join(restarted)}"
            self.say(
                f"the inference {servers} restarted since the weight-transfer group formed: forming it again"
            )
            self.connect()
            self._start(again=True)

        def transmit() -> None:
            for tensor in tensors.values():
                tensor = tensor.to(self.device)
                if self.vllm_nccl:
                    import torch

                    stream = torch.cuda.current_stream() if self.device == "cuda" else None
                    self.group.broadcast(tensor, src=0, stream=stream)
                else:
                    group.broadcast(self.group, tensor, self.timeout_s)

        receive = [
            lambda url=url: self._call(url, "POST", "/update_weights", {"update_info": info})
            for url in self.urls
        ]
        try:
            concurrently([transmit, *receive])
        except Exception as error:
            self.group = None  # the next sync forms it again; a server leaves its group on a failure
            if isinstance(error, ValueError):
                raise
            check_servers(self.urls, self.api_key)  # names a server that died or froze
            servers = " ".join(root_url(url) for url in self.urls)
            raise UserError(
                f"the weight broadcast to the inference servers {servers} failed: {brief(error)}"
            ) from None
        for url in self.urls:
            self._call(url, "POST", "/finish_weight_update")

    def _start(self, again: bool = False) -> list[str]:
        """POST /start_weight_update to every server; returns the roots of those without a group (restarted).
        `again`, once the group formed again: a server that started before it did (vLLM keeps the update
        open across a new group; the builtin engine closes it) goes on, and one without a group is an error."""
        restarted = []
        for url in self.urls:
            try:
                self._call(url, "POST", "/start_weight_update")
            except UserError as error:
                if group.NO_GROUP in str(error) and not again:
                    restarted.append(root_url(url))
                elif not (again and "already active" in str(error)):
                    raise
        return restarted

    def _call(self, url: str, method: str, path: str, body: dict | None = None) -> dict:
        with httpx.Client(headers=headers(self.api_key), verify=ssl_context()) as http:
            if method == "GET":
                response = http.get(root_url(url) + path, timeout=30)
                if response.status_code >= 400:
                    raise UserError(
                        f"the inference server {root_url(url)} answered {path} with "
                        f"{response.status_code}: {response.text[:300]} (started without "
                        "--weight-transfer-config?)"
                    )
                return response.json()
            return reload.post(http, url, path, json=body or {})

    def close(self) -> None:
        """Each server leaves the group (best effort: one already gone has nothing to leave)."""
        for url in self.urls if self.group is not None else []:
            try:
                self._call(url, "POST", "/shutdown_weight_transfer_engine")
            except ValueError:
                pass
        self.group = None


def update_in_memory(sender: Sender, tensors: dict, tied: bool, label: str, pause_mode: str) -> None:
    """Makes every server serve `tensors` under `label`, as reload.reload_weights does for a directory: pause,
    send, then reload.after_load (tied output layer, fingerprint, label, KV) and resume, whatever failed."""
    written, source = written_fingerprints(tensors, tied), f"sent to it in memory for {label}"
    with httpx.Client(headers=headers(sender.api_key), verify=ssl_context()) as http:
        try:
            for url in sender.urls:
                reload.post(http, url, f"/pause?mode={pause_mode}")
            sender.send(tensors)
            for url in sender.urls:
                reload.after_load(http, url, source, written, label, tied)
        finally:
            for url in sender.urls:
                reload.resume(url, sender.api_key)
