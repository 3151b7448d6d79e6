"""The builtin inference engine's request queue and its pause/reload state machine; lib/inference/server/decode.py runs the model."""

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lib.config import UserError
from lib.inference.server import linear
from lib.inference.server.decode import Batch, Completion, Decoder, SamplingParams, Sequence
from lib.inference.server.loading import check_tensors, read_adapter, read_weights
from lib.inference.server.protocol import Tokenizer
from lib.inference.weights import fingerprint
from lib.models.load import ModelConfig, keep_freed_memory, load_model, load_tokenizer

log = logging.getLogger(__name__)

# From idle, the first batch starts once requests stop arriving for BURST_GAP_S, or after BURST_WAIT_S.
BURST_GAP_S = 0.005
BURST_WAIT_S = 0.1
# Waiting sequences join a running batch once they are 1/ADMIT_SHARE of its rows, or after ADMIT_AFTER_STEPS
# decode steps: each join re-lays the whole KV cache, and an evaluation's requests joining ~2 at a time spent
# over half its time in joins and small prefills (SmolLM2, float32, 2 cores; docs/benchmarks.md).
ADMIT_SHARE = 4
ADMIT_AFTER_STEPS = 8


class TooLong(ValueError):
    """A request past max_model_len (vLLM names `input_tokens` as the parameter at fault)."""

    param = "input_tokens"


@dataclasses.dataclass(eq=False)
class Request:
    """One call to `submit`: its n sequences resolve the future together."""

    future: concurrent.futures.Future
    completions: list[Completion | None]
    remaining: int


class Engine:
    """Owns the model, the tokenizer and the worker thread; `submit` is safe to call from any thread.

    One worker thread owns the model: it loads it, and every computation with it (a reload's copy, a
    fingerprint) runs there between two decode steps (_on_worker). Requests wait in a queue; whenever the
    worker is between two decode steps it prefills the waiting prompts (up to max_batch_size sequences in
    all) into the running batch, so a request never waits for another one to finish. Weights change only
    between two decode steps.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        self.reloads = 0
        # The weights an adapter was merged into, by name: a new adapter replaces the old one's sum.
        self._base: dict[str, torch.Tensor] = {}
        # The weights' label, as in vLLM: "default" at start, changed only by a client (POST
        # /update_weight_version); each sequence reports which label produced which of its tokens.
        self.weight_version = "default"
        self._reload_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: collections.deque[list[Sequence]] = collections.deque()
        self._calls: list[tuple[Callable, concurrent.futures.Future]] = []  # work for the worker (_on_worker)
        self._paused = self._reloading = self._busy = self._closed = False
        # pause("keep"): the worker holds the running batch (`_held` once it does); `_recompute`: the
        # held batch's KV is recomputed under the current weights before its next token.
        self._keep = self._held = self._recompute = False
        self._waited = 0  # decode steps the waiting sequences have waited to join the running batch
        self._worker = threading.Thread(target=self._loop, name="plainrl-engine", daemon=True)
        self._worker.start()
        try:
            self._on_worker(lambda: self._load(model_config))
        except BaseException:
            self.close()
            raise
        self.tokenizer = Tokenizer(load_tokenizer(model_config.name))
        config = self.model.config
        self.device = next(self.model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.vocab_size = config.vocab_size
        hf_tokenizer = self.tokenizer.tokenizer
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = frozenset(
            eos + ([hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else [])
        )
        self.decoder = Decoder(self.model, hf_tokenizer.pad_token_id or 0, self.tokenizer.decode, seed)

    def _load(self, model_config: ModelConfig) -> None:
        self.model = load_model(model_config)
        if next(self.model.parameters()).device.type == "cpu":
            keep_freed_memory()  # each decode step allocates its logits and their softmax again
        if any(kind != "full_attention" for kind in getattr(self.model.config, "layer_types", None) or []):
            raise UserError(
                "the builtin engine serves full-attention models only; use --engine vllm for this one."
            )
        self.prepacked = linear.prepacks(self.model)
        if self.prepacked:
            linear.prepack(self.model)
            log.info("linear layers: prepacked for oneDNN")
        elif linear.bf16_on_cpu(self.model):
            log.info("linear layers: plain bf16 matmuls (%s)", linear.PLAIN_REASON)

    # ------------------------------------------------------------ requests
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, in one sentence, for a request this engine cannot serve."""
        if not prompt_ids:
            raise UserError("the prompt is empty.")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise UserError(f"prompt token ids must be in [0, {self.vocab_size}).")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise TooLong(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks for "
                f"{len(prompt_ids) + params.max_tokens} ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} to generate)."
            )
        if params.n > self.max_batch_size:
            raise UserError(
                f"n must be at most the server's max_batch_size ({self.max_batch_size}), got {params.n}."
            )

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queues a prompt; the future resolves to its n Completions. Raises ValueError for a bad request."""
        self.check(prompt_ids, params)
        request = Request(concurrent.futures.Future(), [None] * params.n, params.n)
        end_ids = (frozenset() if params.ignore_eos else self.eos_ids) | frozenset(params.stop_token_ids)
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            seqs.append(Sequence(list(prompt_ids), params, generator, end_ids, request, index))
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed.")
            self._pending.append(seqs)
            self._cond.notify_all()
        return request.future

    # ------------------------------------------------------------ pause and reload
    def pause(self, mode: str = "wait", clear_cache: bool = True) -> None:
        """Holds new sequences, and the running ones: wait lets them finish first (none then mixes two
        policies); keep holds them where they are (returns at the next step boundary) until `resume`,
        and they go on under the weights then loaded. clear_cache then drops the held sequences' KV, as
        vLLM's pause does in every mode: it is recomputed under the new weights at `resume` (without it, and
        without reset_prefix_cache(True), they go on from KV the old weights computed)."""
        assert mode in ("wait", "keep"), f"unknown pause mode {mode!r}"
        with self._cond:
            self._paused = True
            self._keep = mode == "keep"
            self._cond.notify_all()  # a batch held by an earlier keep goes on (wait)
            self._cond.wait_for(self._settled)
            self._recompute = self._recompute or (clear_cache and self._held)

    def resume(self) -> None:
        with self._cond:
            self._paused = self._keep = False
            self._cond.notify_all()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's answer: the builtin engine shares no KV between requests, so the only KV that can outlive
        a reload is the running (or held) sequences' own. Without `reset_running_requests` that is a
        failure (False) while any sequence still holds its KV, as in vLLM; with it their KV is recomputed,
        under the weights then loaded, before their next token (vLLM preempts them and recomputes)."""
        with self._cond:
            self._recompute = self._recompute or (reset_running_requests and self._busy)
            return self._recompute or not self._busy

    def _settled(self) -> bool:
        """No decode step runs: the worker is idle, or holds its batch for a keep pause. Lock held."""
        return not self._busy or (self._keep and self._held)

    @property
    def paused(self) -> bool:
        return self._paused

    def reload(self, directory: str | Path) -> int:
        """Loads a safetensors directory between two decode steps; returns how many reloads there have been.

        It stops admitting new sequences and copies the tensors in once no step runs: without a keep
        pause it first waits until the running sequences finish.
        """
        with self._reload_lock:
            # Read before waiting, between two steps of the running batch: the pause stays short.
            tensors = self._on_worker(lambda: read_weights(self.model, Path(directory)))
            self._swap(tensors)
            self._base = {}  # the new weights are what the next adapter adds to
            log.info("loaded weights from %s (reload %d)", directory, self.reloads)
            return self.reloads

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        """Loads weights received in memory (lib/inference/server/transfer.py) as `reload` loads a directory's."""
        with self._reload_lock:
            check_tensors(self.model, tensors, "the update received in memory")
            self._swap(tensors)
            self._base = {}
            log.info("loaded %d weights received in memory (reload %d)", len(tensors), self.reloads)
            return self.reloads

    def load_adapter(self, directory: str | Path, max_rank: int) -> int:
        """Serves the base weights plus the LoRA adapter in `directory`, merged, in place of any adapter
        loaded before (as `reload`, between two decode steps). vLLM keeps the adapter apart, so its base
        model name still answers with the base weights; here every name gets the merged ones."""
        with self._reload_lock:
            self._swap(self._on_worker(lambda: self._merged(Path(directory), max_rank)))
            log.info("loaded LoRA adapter %s (reload %d)", directory, self.reloads)
            return self.reloads

    def _merged(self, directory: Path, max_rank: int) -> dict[str, torch.Tensor]:
        """The weights with the adapter in `directory` added to the ones it replaces (load_adapter)."""
        deltas = read_adapter(self.model, directory, max_rank)
        params = dict(self.model.named_parameters())
        for name in deltas.keys() - self._base.keys():
            self._base[name] = params[name].detach().clone()
        return {
            name: (base.float() + deltas[name]).to(base.dtype) if name in deltas else base
            for name, base in self._base.items()  # a layer the new adapter leaves out goes back to base
        }

    def weight_fingerprint(self) -> dict:
        """{"dtype", "engine", "weights": {weight name: fingerprint}} of the parameters the model computes with,
        a merged adapter included (lib/inference/weights/fingerprint.py), the tied output layer under its own name too."""
        with self._reload_lock:  # never half-way through a swap
            weights = self._on_worker(self._fingerprints)
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return {"dtype": dtype, "engine": 0, "weights": weights}

    def _fingerprints(self) -> dict:
        weights, seen = {}, {}  # a tied output layer is the embedding's tensor: fingerprinted once
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) not in seen:
                seen[id(param)] = fingerprint.of_tensor(param.detach())
            weights[name] = seen[id(param)]
        return weights

    def _swap(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._reloading = True
            self._cond.wait_for(self._settled)
        try:
            self._on_worker(lambda: self._copy_in(tensors))
            self.reloads += 1
        finally:
            with self._cond:
                self._reloading = False
                self._cond.notify_all()

    def _copy_in(self, tensors: dict[str, torch.Tensor]) -> None:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor)
            if self.prepacked:
                linear.prepack(self.model)  # the copies the linear layers compute with

    def _on_worker(self, work: Callable):
        """work() run by the worker thread between two decode steps (or while it idles or holds its batch),
        and its result; its exception is raised here. The worker is the only thread of the server that
        computes with several threads: libgomp spins each of its threads only ~100 rounds before sleeping
        once it manages more threads than the CPU has cores, so a second thread's 2-thread work (the model's
        loading, a reload's copy) made every later parallel operator of the decode step wake sleeping
        threads: a 32-row SmolLM2 decode step took 180 ms instead of 147 (float32, 2 cores)."""
        if threading.current_thread() is self._worker:
            return work()
        future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed.")
            self._calls.append((work, future))
            self._cond.notify_all()
        return future.result()

    def _run_calls(self) -> None:
        with self._cond:
            calls, self._calls = self._calls, []
        for work, future in calls:
            try:
                future.set_result(work())
            except Exception as error:  # the caller's to raise (a UserError about its weights, say)
                future.set_exception(error)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    # ------------------------------------------------------------ worker
    def _loop(self) -> None:
        batch: Batch | None = None
        while True:
            self._run_calls()
            with self._cond:
                if batch is None:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait_for(
                        lambda: self._closed or self._calls or (self._pending and self._admitting())
                    )
                    if self._closed:
                        break
                    if self._calls:
                        continue
                    self._busy = True
                    self._gather_burst()
                elif self._keep:  # paused with mode=keep: decode nothing until resume (or another mode)
                    self._held = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._closed or self._calls or not self._keep)
                    if self._calls and not self._closed:
                        continue  # run them with the batch still held
                    self._held = False
                    if self._closed:
                        break
                recompute, self._recompute = self._recompute, False
                new, rows = [], len(batch.seqs) if batch else 0
                while (
                    self._pending
                    and self._admitting()
                    and rows + len(new) + len(self._pending[0]) <= self.max_batch_size
                    and (new or self._joins_now(rows))
                ):
                    seqs = self._pending.popleft()
                    # Running futures cannot be cancelled any more; a cancelled one lost its caller: skip it.
                    if seqs[0].request.future.set_running_or_notify_cancel():
                        new += seqs
            try:
                with torch.inference_mode():
                    if recompute and batch is not None:
                        self.decoder.recompute(batch)
                    batch, finished = self.decoder.step(batch, new, self.weight_version)
                for seq, completion in finished:
                    self._resolve(seq, completion)
            # A failed step (out of memory, a bug) must not take the server down: fail its requests, go on.
            except Exception as error:
                log.exception("generation step failed")
                for seq in (batch.seqs if batch else []) + new:
                    if not seq.request.future.done():
                        seq.request.future.set_exception(RuntimeError(f"generation failed: {error!r}"))
                batch = None
        with self._cond:
            for seq in batch.seqs if batch else []:  # held by pause("keep") when the engine closed
                if not seq.request.future.done():
                    seq.request.future.set_exception(RuntimeError("the engine was closed."))
            for seqs in self._pending:
                if seqs[0].request.future.set_running_or_notify_cancel():
                    seqs[0].request.future.set_exception(RuntimeError("the engine was closed."))
            for _, future in self._calls:
                future.set_exception(RuntimeError("the engine was closed."))

    def _gather_burst(self) -> None:
        """Starting from idle, waits while requests keep arriving (BURST_GAP_S apart at most), up to BURST_WAIT_S.

        A burst of requests reaches the HTTP server over some milliseconds; starting on the first one
        would decode it nearly alone while the others trickle in. Called with the lock held.
        """
        deadline = time.monotonic() + BURST_WAIT_S
        while sum(len(seqs) for seqs in self._pending) < self.max_batch_size and time.monotonic() < deadline:
            waiting = len(self._pending)
            self._cond.wait(timeout=BURST_GAP_S)
            if len(self._pending) == waiting or self._closed:
                return

    def _joins_now(self, rows: int) -> bool:
        """Whether the waiting sequences join a batch of `rows` running ones at this step (ADMIT_SHARE):
        counts the steps they waited. Called with the lock held."""
        waiting = sum(len(seqs) for seqs in self._pending)
        if rows and waiting * ADMIT_SHARE < rows and self._waited < ADMIT_AFTER_STEPS:
            self._waited += 1
            return False
        self._waited = 0
        return True

    def _admitting(self) -> bool:
        return not self._paused and not self._reloading

    def _resolve(self, seq: Sequence, completion: Completion) -> None:
        """Files a finished sequence with its request, which resolves once all its n sequences are in."""
        request = seq.request
        request.completions[seq.index] = completion
        request.remaining -= 1
        if request.remaining == 0:
            request.future.set_result(request.completions)
