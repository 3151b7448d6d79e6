"""The builtin inference engine: continuous batching on a KV cache, exact logprobs, live weight reload.

One worker thread owns the model. Requests wait in a queue; whenever the worker is between two decode
steps it prefills the waiting prompts (up to max_batch_size sequences in all) and merges them into the
running batch, left-padded, so a request never waits for another one to finish. Starting from idle it
first lets a burst of requests arrive (a few milliseconds), so they share one prefill. Every row carries
its own attention mask and position ids, so a sequence's logits do not depend on what it is batched with.

Logprobs are those of the distribution each token was actually drawn from: temperature, then top-k,
then top-p, renormalised (vLLM's `--logprobs-mode processed_logprobs`). Greedy decoding (temperature 0)
has no such distribution; it reports the plain softmax (temperature 1), the model's own probability
of the argmax token.

Weights change between two decode steps. `reload` stops admitting new sequences and copies the new
tensors in once no step runs: after `pause("wait")` (or without a pause) it first waits until the
running sequences finish, so none mixes two policies; after `pause("keep")` (vLLM's mode) the running
sequences are held and go on under the new weights after `resume`. As vLLM does, the pause drops their
KV cache (clear_cache, on by default), and `reset_prefix_cache(reset_running_requests=True)` does so
later: their prompt and tokens so far are then recomputed under the weights loaded at `resume`. With
clear_cache=False and no such reset they go on from KV computed by the old weights.
As in vLLM, the weights' label (`weight_version`, "default" at start) changes only when a client sets
it (POST /update_weight_version); each sequence reports which label produced which of its tokens.
"""

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lib.config import UserError
from lib.model import ModelConfig, load_model, load_tokenizer

log = logging.getLogger(__name__)

# What JSON carries instead of -inf (a filtered-out token's logprob), as vLLM does.
LOGPROB_FLOOR = -9999.0
# From idle, the first batch starts once requests stop arriving for BURST_GAP_S, or after BURST_WAIT_S.
BURST_GAP_S = 0.005
BURST_WAIT_S = 0.1


class TooLong(ValueError):
    """A request past max_model_len (vLLM names `input_tokens` as the parameter at fault)."""

    param = "input_tokens"


@dataclasses.dataclass
class SamplingParams:
    """What one request asks for (vLLM's names); the server builds it from a validated HTTP body."""

    max_tokens: int
    """Most new tokens per sequence."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass kept (1 = off)."""
    top_k: int = -1
    """Keep only the k most likely tokens (-1 = off)."""
    n: int = 1
    """Sequences sampled from the prompt."""
    seed: int | None = None
    """Seed of this request's own generator (sequence i uses seed + i); None = the engine's generator."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Strings that end a sequence; the text is cut before them, the tokens are kept (as in vLLM)."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Token ids that end a sequence; the token is kept."""
    ignore_eos: bool = False
    """Keep going past the end-of-sequence token (benchmarks)."""
    top_logprobs: int = 0
    """Also return the k most likely tokens at every step."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""


@dataclasses.dataclass
class Completion:
    """One finished sequence."""

    token_ids: list[int]
    """Sampled tokens, the one that stopped the sequence included."""
    logprobs: list[float]
    """Logprob of each sampled token under the distribution it was drawn from."""
    ranks: list[int]
    """Rank of each sampled token in that distribution (1 = the most likely), as vLLM reports it."""
    top_logprobs: list[list[tuple[int, float]]]
    """Per step, the k most likely (token id, logprob) pairs; empty when none were asked for."""
    text: str
    """The decoded tokens, cut at the stop string."""
    finish_reason: str
    """stop (end token, stop token or stop string), length (max_tokens) or abort (pause with mode=abort)."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the sequence (None for the end-of-sequence token)."""
    weight_versions: list[tuple[str, int, int]]
    """(label, start, end): tokens [start, end) were sampled by the weights labelled so (vLLM's spans)."""


@dataclasses.dataclass(eq=False)
class _Request:
    """One call to `submit`: its n sequences resolve the future together."""

    future: concurrent.futures.Future
    completions: list
    remaining: int


@dataclasses.dataclass(eq=False)
class _Sequence:
    """One sequence being generated, and what it has produced so far."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    request: _Request
    index: int
    end_ids: frozenset[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    text: str | None = None
    version_starts: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (label, first token)


@dataclasses.dataclass(eq=False)
class _Batch:
    """The sequences decoded together, and their per-row state. Row i of every tensor is seqs[i]."""

    seqs: list[_Sequence]
    cache: object  # transformers DynamicCache, (B, heads, T, head_dim) per layer
    attention_mask: torch.Tensor  # (B, T), 0 on left padding
    positions: torch.Tensor  # (B,) position id of next_tokens
    temperature: torch.Tensor  # (B,) 1 for greedy rows
    top_k: torch.Tensor  # (B,) vocabulary size when off
    top_p: torch.Tensor  # (B,)
    greedy: torch.Tensor  # (B,) bool
    next_tokens: torch.Tensor | None = None  # (B,) sampled, not yet fed to the model


ROW_TENSORS = ("positions", "temperature", "top_k", "top_p", "greedy", "next_tokens")


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf (vLLM's order and ties)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of the strictly more likely tokens
    # Rows with top_p = 1 are left alone: rounding could otherwise push the cumulative mass past 1.
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, filtered: bool
) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from: logits / temperature, top-k, top-p, renormalised.

    Greedy rows must come with temperature 1 and no filtering, so they get the plain softmax.
    """
    scaled = logits.float() / temperature[:, None]  # (B, V)
    if filtered:
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    return torch.log_softmax(scaled, dim=-1)


def read_weights(model, directory: Path) -> dict[str, torch.Tensor]:
    """Reads a Hugging Face safetensors directory and checks it holds exactly this model's tensors."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} holds no .safetensors files.")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    state = model.state_dict()
    required = {name for name, _ in model.named_parameters()}  # a tied weight is listed once
    unknown, missing = sorted(set(tensors) - set(state)), sorted(required - set(tensors))
    if unknown or missing:
        raise UserError(
            f"{directory} does not fit the served model (missing {missing[:3]}, unknown {unknown[:3]})."
        )
    for name, tensor in tensors.items():
        if tensor.shape != state[name].shape:
            raise UserError(
                f"{directory}: {name} has shape {tuple(tensor.shape)}, the model {tuple(state[name].shape)}."
            )
    return tensors


class Engine:
    """Owns the model, the tokenizer and the worker thread; `submit` is safe to call from any thread."""

    def __init__(
        self,
        model_config: ModelConfig,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        self.model = load_model(model_config)
        self.tokenizer = load_tokenizer(model_config.name)
        config = self.model.config
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
            raise UserError(
                "the builtin engine serves full-attention models only; use --engine vllm for this one."
            )
        self.device = next(self.model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.vocab_size = config.vocab_size
        self.pad_id = self.tokenizer.pad_token_id or 0
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = frozenset(
            eos + ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.reloads = 0
        self.weight_version = "default"
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self._reload_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: collections.deque[list[_Sequence]] = collections.deque()
        self._paused = self._reloading = self._abort = self._busy = self._closed = False
        # pause("keep"): the worker holds the running batch (`_held` once it does); `_recompute`: the
        # held batch's KV is recomputed under the current weights before its next token.
        self._keep = self._held = self._recompute = False
        self._worker = threading.Thread(target=self._loop, name="plainrl-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ tokenizer (shared with the HTTP side)
    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of the chat template's rendering, encoded without extra special tokens (as vLLM does)."""
        from jinja2 import TemplateError

        with self._tokenizer_lock:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
            except TemplateError as error:  # templates refuse bad conversations by raising: a user error
                raise UserError(f"the chat template rejected the messages ({error}).") from error
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (the `token` field of OpenAI logprobs)."""
        with self._tokenizer_lock:
            return [self.tokenizer.decode([token]) for token in token_ids]

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
        request = _Request(concurrent.futures.Future(), [None] * params.n, params.n)
        end_ids = (frozenset() if params.ignore_eos else self.eos_ids) | frozenset(params.stop_token_ids)
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            seqs.append(_Sequence(list(prompt_ids), params, generator, request, index, end_ids))
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed.")
            self._pending.append(seqs)
            self._cond.notify_all()
        return request.future

    def pause(self, mode: str = "wait", clear_cache: bool = True) -> None:
        """Holds new sequences, and the running ones: wait lets them finish first, abort ends them at the
        next token, keep holds them where they are (returns at the next step boundary) until `resume`.
        clear_cache then drops the held sequences' KV, as vLLM's pause does in every mode."""
        with self._cond:
            self._paused = True
            self._keep = mode == "keep"
            self._abort = self._abort or mode == "abort"
            self._cond.notify_all()  # a batch held by an earlier keep goes on (wait) or ends (abort)
            self._cond.wait_for(self._settled)
            self._recompute = self._recompute or (clear_cache and self._held)

    def resume(self) -> None:
        with self._cond:
            self._paused = self._abort = self._keep = False
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
        """Loads a safetensors directory between two batches; returns how many reloads there have been."""
        with self._reload_lock:
            tensors = read_weights(self.model, Path(directory))  # read before waiting: the pause stays short
            with self._cond:
                self._reloading = True
                self._cond.wait_for(self._settled)
            try:
                state = self.model.state_dict()
                with torch.no_grad():
                    for name, tensor in tensors.items():
                        state[name].copy_(tensor)
                self.reloads += 1
            finally:
                with self._cond:
                    self._reloading = False
                    self._cond.notify_all()
            log.info("loaded weights from %s (reload %d)", directory, self.reloads)
            return self.reloads

    def prompt_logprobs(self, prompt_ids: list[int], k: int) -> list[list[tuple[int, float, int]] | None]:
        """vLLM's prompt logprobs: for each prompt token after the first, (token, logprob, rank) of the
        token itself and then the k most likely, under the model's raw distribution (no temperature or
        filter: vLLM applies neither to prompt logprobs). None for the first token."""
        with self._reload_lock, torch.inference_mode():  # weights do not change under it
            ids = torch.tensor([prompt_ids], device=self.device)
            logprobs = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
            targets = ids[0, 1:]  # (T-1,)
            chosen = logprobs.gather(-1, targets[:, None])  # (T-1, 1)
            ranks = (logprobs > chosen).sum(-1) + 1  # (T-1,)
            top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], targets[:, None][:, :0])
        out = [None]
        rows = zip(
            targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist()
        )
        for token, logprob, rank, ids_k, values_k in rows:
            out.append(
                [(token, logprob, rank), *((t, v, i + 1) for i, (t, v) in enumerate(zip(ids_k, values_k)))]
            )
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    # ------------------------------------------------------------ worker
    def _loop(self) -> None:
        batch: _Batch | None = None
        while True:
            with self._cond:
                if batch is None:
                    self._busy = self._abort = False
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._closed or (self._pending and self._admitting()))
                    if self._closed:
                        break
                    self._busy = True
                    self._gather_burst()
                elif self._keep:  # paused with mode=keep: decode nothing until resume (or another mode)
                    self._held = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._closed or not self._keep)
                    self._held = False
                    if self._closed:
                        break
                recompute, self._recompute = self._recompute, False
                new, rows = [], len(batch.seqs) if batch else 0
                while (
                    self._pending
                    and self._admitting()
                    and rows + len(new) + len(self._pending[0]) <= self.max_batch_size
                ):
                    seqs = self._pending.popleft()
                    # Running futures cannot be cancelled any more; a cancelled one lost its caller: skip it.
                    if seqs[0].request.future.set_running_or_notify_cancel():
                        new += seqs
                abort = self._abort
            try:
                with torch.inference_mode():
                    if abort and batch is not None:
                        for seq in batch.seqs:
                            self._finish(seq, "abort", None)
                        batch = None
                    if recompute and batch is not None:
                        batch.cache, batch.attention_mask, _ = self._forward(
                            [seq.prompt_ids + seq.token_ids[:-1] for seq in batch.seqs]
                        )
                    if new:
                        batch = self._join(batch, self._prefill(new))
                    if batch is not None:
                        batch = self._decode(batch)
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

    def _admitting(self) -> bool:
        return not self._paused and not self._reloading

    def _forward(self, histories: list[list[int]]) -> tuple[object, torch.Tensor, torch.Tensor]:
        """Runs the model over token lists, left-padded: their KV cache, attention mask and last logits."""
        from transformers import DynamicCache

        width = max(len(ids) for ids in histories)
        ids = torch.tensor([[self.pad_id] * (width - len(h)) + h for h in histories], device=self.device)
        mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in histories], device=self.device)
        # Every row counts positions from 0 at its first real token, whatever its padding.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, mask, out.logits[:, -1]

    def _prefill(self, seqs: list[_Sequence]) -> _Batch | None:
        cache, mask, logits = self._forward([seq.prompt_ids for seq in seqs])
        settings = []  # (temperature, top_k, top_p) per row
        for seq in seqs:
            params = seq.params
            if params.temperature == 0:  # greedy: temperature 1 and no filter report the plain softmax
                settings.append((1.0, self.vocab_size, 1.0))
            else:
                top_k = params.top_k if params.top_k > 0 else self.vocab_size
                settings.append((params.temperature, top_k, params.top_p))
        greedy = torch.tensor([seq.params.temperature == 0 for seq in seqs], device=self.device)
        temperature, top_k, top_p = (torch.tensor(column, device=self.device) for column in zip(*settings))
        lengths = torch.tensor([len(seq.prompt_ids) for seq in seqs], device=self.device)
        batch = _Batch(seqs, cache, mask, lengths, temperature, top_k, top_p, greedy)
        return self._sample(batch, logits)

    def _decode(self, batch: _Batch) -> _Batch | None:
        batch.attention_mask = torch.cat(
            [batch.attention_mask, batch.attention_mask.new_ones(len(batch.seqs), 1)], dim=1
        )
        out = self.model(
            input_ids=batch.next_tokens[:, None],
            attention_mask=batch.attention_mask,
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.positions = batch.positions + 1
        return self._sample(batch, out.logits[:, -1])

    def _sample(self, batch: _Batch, logits: torch.Tensor) -> _Batch | None:
        """Draws one token per row, records it, and drops the rows that finished."""
        seqs = batch.seqs
        filtered = any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs)
        logprobs = processed_logprobs(logits, batch.temperature, batch.top_k, batch.top_p, filtered)  # (B, V)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, and batches across rows.
        noise = torch.empty_like(logprobs).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        tokens = (logprobs - noise.clamp_(min=torch.finfo(noise.dtype).tiny).log()).argmax(dim=-1)  # (B,)
        tokens = torch.where(batch.greedy, logprobs.argmax(dim=-1), tokens)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
        ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()  # (B,)
        k = max(s.params.top_logprobs for s in seqs)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)  # (B, k)
        tokens_list, chosen_list = tokens.tolist(), chosen.tolist()
        if k:
            top_values, top_ids = top_values.clamp(min=LOGPROB_FLOOR).tolist(), top_ids.tolist()
        keep, label = [], self.weight_version
        for row, seq in enumerate(seqs):
            token = tokens_list[row]
            if not seq.version_starts or seq.version_starts[-1][0] != label:
                seq.version_starts.append((label, len(seq.token_ids)))
            seq.token_ids.append(token)
            seq.logprobs.append(chosen_list[row])
            seq.ranks.append(ranks[row])
            if seq.params.top_logprobs:
                count = seq.params.top_logprobs
                seq.top_logprobs.append(list(zip(top_ids[row][:count], top_values[row][:count])))
            if not self._check_finished(seq, token):
                keep.append(row)
        batch.next_tokens = tokens
        if len(keep) == len(seqs):
            return batch
        return self._select(batch, keep) if keep else None

    def _check_finished(self, seq: _Sequence, token: int) -> bool:
        params = seq.params
        if token in seq.end_ids:
            self._finish(seq, "stop", token if token in params.stop_token_ids else None)
            return True
        stop = self._find_stop_string(seq) if params.stop else None
        if stop is not None:
            self._finish(seq, "stop", stop)
            return True
        if len(seq.token_ids) >= params.max_tokens:
            self._finish(seq, "length", None)
            return True
        return False

    def _find_stop_string(self, seq: _Sequence) -> str | None:
        """The first stop string in the text so far, which is then cut there; None if there is none yet."""
        # Decoding the whole completion each step is simple and exact (a stop string may span tokens).
        text = self.decode(seq.token_ids, seq.params.skip_special_tokens)
        hits = [(text.find(stop), stop) for stop in seq.params.stop if stop in text]
        if not hits:
            return None
        at, stop = min(hits)
        seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
        return stop

    def _finish(self, seq: _Sequence, reason: str, stop_reason: int | str | None) -> None:
        text = (
            seq.text if seq.text is not None else self.decode(seq.token_ids, seq.params.skip_special_tokens)
        )
        request = seq.request
        ends = [start for _, start in seq.version_starts[1:]] + [len(seq.token_ids)]
        spans = [(label, start, end) for (label, start), end in zip(seq.version_starts, ends)]
        request.completions[seq.index] = Completion(
            seq.token_ids, seq.logprobs, seq.ranks, seq.top_logprobs, text, reason, stop_reason, spans
        )
        request.remaining -= 1
        if request.remaining == 0:
            request.future.set_result(request.completions)

    def _select(self, batch: _Batch, keep: list[int]) -> _Batch:
        """Keeps the given rows, and drops the left columns that are padding in every remaining row."""
        from transformers import DynamicCache

        index = torch.tensor(keep, device=self.device)
        mask = batch.attention_mask[index]
        start = int(mask.any(dim=0).int().argmax())
        cache = DynamicCache(
            [(keys[index, :, start:], values[index, :, start:]) for keys, values, _ in batch.cache],
            config=self.model.config,
        )
        rows = {name: getattr(batch, name)[index] for name in ROW_TENSORS}
        return _Batch([batch.seqs[row] for row in keep], cache, mask[:, start:], **rows)

    def _join(self, old: _Batch | None, new: _Batch | None) -> _Batch | None:
        """One batch of both: the shorter history is left-padded (masked) to the longer one."""
        from transformers import DynamicCache

        if old is None or new is None:
            return old or new
        width = max(old.attention_mask.shape[1], new.attention_mask.shape[1])

        def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - tensor.shape[dim]
            return F.pad(tensor, (0, 0, missing, 0) if dim == 2 else (missing, 0))

        layers = [
            (torch.cat([pad(k_old, 2), pad(k_new, 2)]), torch.cat([pad(v_old, 2), pad(v_new, 2)]))
            for (k_old, v_old, _), (k_new, v_new, _) in zip(old.cache, new.cache)
        ]
        rows = {name: torch.cat([getattr(old, name), getattr(new, name)]) for name in ROW_TENSORS}
        mask = torch.cat([pad(old.attention_mask, 1), pad(new.attention_mask, 1)])
        return _Batch(old.seqs + new.seqs, DynamicCache(layers, config=self.model.config), mask, **rows)
