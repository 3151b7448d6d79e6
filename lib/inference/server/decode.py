"""The builtin engine's decode step: left-padded KV rows, prefill and decode, sampling, stop detection."""

import dataclasses
import os
from collections.abc import Callable

import torch
from transformers import DynamicCache

from lib.inference.server.kv import kv_cache, selected, stacked
from lib.inference.server.sampler import draw, processed_logprobs
from lib.inference.server.scoring import prompt_logprobs

# What JSON carries instead of -inf (a filtered-out token's logprob), as vLLM does.
LOGPROB_FLOOR = -9999.0


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
    sampling_mask: bool = False
    """Also return each sampled token's kept set: the ids top-k/top-p left (vLLM's --return-sampling-mask)."""
    prompt_logprobs: int | None = None
    """Also return each prompt token's logprob, with this many most likely tokens beside it (None = none)."""


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
    """stop (end token, stop token or stop string) or length (max_tokens)."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the sequence (None for the end-of-sequence token)."""
    weight_versions: list[tuple[str, int, int]]
    """(label, start, end): tokens [start, end) were sampled by the weights labelled so (vLLM's spans)."""
    sampling_mask: list[list[int]] | None = None
    """Per sampled token, the ids its top-k/top-p step kept, ascending (vLLM's `sampling_mask`); None unless asked."""
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None
    """Per prompt token after the first, (token, logprob, rank) of it and the most likely ones (scoring.py); None unless asked."""


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sequence being generated, and what it has produced so far."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    end_ids: frozenset[int]
    request: object  # the engine's request this sequence answers (decoding never reads it)
    index: int  # its place among the request's n sequences
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # Per token, when params.sampling_mask: the ids the filter kept.
    kept_ids: list[list[int]] = dataclasses.field(default_factory=list)
    text: str | None = None
    version_starts: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (label, first token)
    prompt_logprobs: list | None = None  # scoring.py's, when params.prompt_logprobs asks for them


@dataclasses.dataclass(eq=False)
class Batch:
    """The sequences decoded together, and their per-row state. Row i of every tensor is seqs[i]."""

    seqs: list[Sequence]
    cache: DynamicCache  # kv.py kv_cache's
    attention_mask: torch.Tensor  # (B, T), 0 on left padding
    positions: torch.Tensor  # (B,) position id of next_tokens
    temperature: torch.Tensor  # (B,) 1 for greedy rows
    top_k: torch.Tensor  # (B,) vocabulary size when off
    top_p: torch.Tensor  # (B,)
    greedy: torch.Tensor  # (B,) bool
    next_tokens: torch.Tensor | None = None  # (B,) sampled, not yet fed to the model


ROW_TENSORS = ("positions", "temperature", "top_k", "top_p", "greedy", "next_tokens")


Finished = list[tuple[Sequence, Completion]]


# Prompts of a prefill that begin with at least this many tokens alike compute them once: an evaluation's
# prompts share their system prompt (30 of SmolLM2's 42 tokens on arithmetic), as vLLM's prefix cache finds.
SHARED_PREFIX = 16


class Decoder:
    """Runs the model over a batch: every row carries its own attention mask and position ids, so a
    sequence's logits do not depend on what it is batched with."""

    def __init__(self, model, pad_id: int, detokenize: Callable[[list[int], bool], str], seed: int):
        self.model = model
        self.pad_id = pad_id
        self.detokenize = detokenize  # (token ids, skip_special_tokens) -> text
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # lib/models/load.py's CPU attention reads a float32 cache in blocks without casting it each step (kv.py).
        self.blocks = model.config._attn_implementation == "plainrl_grouped_sdpa"
        self.cache_dtype = torch.float32 if self.blocks else None

    def step(self, batch: Batch | None, new: list[Sequence], label: str) -> tuple[Batch | None, Finished]:
        """Prefills `new` into `batch` and decodes one token for every row: the batch that goes on, and the
        sequences that finished with their completions. `label` names the weights that sample."""
        finished = []
        if new:
            batch = self.join(batch, self.prefill(new, label, finished))
        if batch is not None:
            batch = self.decode(batch, label, finished)
        return batch, finished

    def recompute(self, batch: Batch) -> None:
        """Recomputes the batch's KV under the current weights (all but the sampled, not yet fed, token)."""
        batch.cache, batch.attention_mask, *_ = self.forward(
            [seq.prompt_ids + seq.token_ids[:-1] for seq in batch.seqs]
        )

    def forward(self, histories: list[list[int]], hidden: bool = False) -> tuple:
        """Runs the model over token lists, left-padded: their KV cache, attention mask, last logits (B, V) and,
        with `hidden`, every position's last hidden state (B, T, H) (else None). Equal lists (a group's rollouts
        share their prompt) run once, and their rows are copied; so does the beginning all the lists share, once
        it is SHARED_PREFIX tokens or more (a row's padding then lies between it and the row's own tokens)."""
        rows = {ids: row for row, ids in enumerate(dict.fromkeys(map(tuple, histories)))}
        if len(rows) < len(histories) and not hidden:
            cache, mask, logits, _ = self.forward([list(ids) for ids in rows])
            index = torch.tensor([rows[tuple(ids)] for ids in histories], device=self.device)
            return selected(cache, index)[0], mask[index], logits[index], None
        shared = 0
        if (
            len(histories) > 1 and not hidden
        ):  # each keeps its last token: its logits come from the rows' forward
            shared = min(len(os.path.commonprefix(histories)), min(map(len, histories)) - 1)
            shared = shared if shared >= SHARED_PREFIX else 0
        cache, rests = self.cache(), [h[shared:] for h in histories]
        if shared:  # the common beginning once, its keys and values then copied to every row
            prefix = torch.tensor([histories[0][:shared]], device=self.device)
            self.model.model(input_ids=prefix, past_key_values=cache, use_cache=True)
            cache = selected(cache, torch.zeros(len(histories), dtype=torch.long, device=self.device))[0]
        width = max(len(ids) for ids in rests)
        ids = torch.tensor([[self.pad_id] * (width - len(h)) + h for h in rests], device=self.device)
        # The mask covers the shared columns too; a row's padding lies between them and its own tokens.
        mask = torch.tensor(
            [[1] * shared + [0] * (width - len(h)) + [1] * len(h) for h in rests], device=self.device
        )
        # Every row counts positions from 0 at its first real token, whatever its padding.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]  # (B, T)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if not hidden:
            out = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return cache, mask, out.logits[:, -1], None
        states = self.model.model(
            **inputs, past_key_values=cache, use_cache=True
        ).last_hidden_state  # (B, T, H)
        return cache, mask, self.model.get_output_embeddings()(states[:, -1]), states

    def prefill(self, seqs: list[Sequence], label: str, finished: Finished) -> Batch | None:
        # The prompts scored for their logprobs (a teacher's requests) run together, keeping every position's
        # hidden state for scoring.py, under the weights that sample their first token (as vLLM's prefill);
        # the other prompts run together too, keeping the last position's.
        scored = [seq for seq in seqs if seq.params.prompt_logprobs is not None]
        plain = [seq for seq in seqs if seq.params.prompt_logprobs is None]
        parts = [
            self.forward([s.prompt_ids for s in part], part is scored) for part in (plain, scored) if part
        ]
        for row, seq in enumerate(scored):
            states = parts[-1][3][row, -len(seq.prompt_ids) :]  # (T, H): the prompt's own positions
            seq.prompt_logprobs = prompt_logprobs(
                self.model, states, seq.prompt_ids, seq.params.prompt_logprobs
            )
        seqs = plain + scored
        cache, mask = self.stacked([part[:2] for part in parts])
        logits = torch.cat([part[2] for part in parts])  # (B, V)
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
        batch = Batch(seqs, cache, mask, lengths, temperature, top_k, top_p, greedy)
        return self.sample(batch, logits, label, finished)

    def decode(self, batch: Batch, label: str, finished: Finished) -> Batch | None:
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
        return self.sample(batch, out.logits[:, -1], label, finished)

    def sample(self, batch: Batch, logits: torch.Tensor, label: str, finished: Finished) -> Batch | None:
        """Draws one token per row, records it, and moves the rows that finished to `finished`."""
        seqs = batch.seqs
        filtered = any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs)
        logprobs = processed_logprobs(logits, batch.temperature, batch.top_k, batch.top_p, filtered)  # (B, V)
        # One uniform number a row (a seeded request's from its own generator) picks its token.
        uniform = torch.rand(
            len(seqs), dtype=torch.float64, generator=self.generator, device=self.device
        )  # (B,)
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                uniform[row] = torch.rand(
                    (), dtype=torch.float64, generator=seq.generator, device=self.device
                )
        tokens = draw(logprobs, uniform)  # (B,)
        if bool(batch.greedy.any()):
            tokens = torch.where(batch.greedy, logprobs.argmax(dim=-1), tokens)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
        ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()  # (B,)
        k = max(s.params.top_logprobs for s in seqs)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)  # (B, k)
        tokens_list, chosen_list = tokens.tolist(), chosen.tolist()
        if k:
            top_values, top_ids = top_values.clamp(min=LOGPROB_FLOOR).tolist(), top_ids.tolist()
        # The kept set is what the filter left finite: ascending ids, as vLLM compacts them.
        kept = logprobs.isfinite() if any(s.params.sampling_mask for s in seqs) else None  # (B, V)
        keep = []
        for row, seq in enumerate(seqs):
            token = tokens_list[row]
            if not seq.version_starts or seq.version_starts[-1][0] != label:
                seq.version_starts.append((label, len(seq.token_ids)))
            seq.token_ids.append(token)
            if seq.params.sampling_mask:
                seq.kept_ids.append(kept[row].nonzero().squeeze(-1).tolist())
            seq.logprobs.append(chosen_list[row])
            seq.ranks.append(ranks[row])
            if seq.params.top_logprobs:
                count = seq.params.top_logprobs
                seq.top_logprobs.append(list(zip(top_ids[row][:count], top_values[row][:count])))
            completion = self.completion_if_finished(seq, token)
            if completion is None:
                keep.append(row)
            else:
                finished.append((seq, completion))
        batch.next_tokens = tokens
        if len(keep) == len(seqs):
            return batch
        return self.select(batch, keep) if keep else None

    def completion_if_finished(self, seq: Sequence, token: int) -> Completion | None:
        """The sequence's completion when `token` ended it (end token, stop string, max_tokens), else None."""
        params = seq.params
        if token in seq.end_ids:
            return self.completion(seq, "stop", token if token in params.stop_token_ids else None)
        stop = self.find_stop_string(seq) if params.stop else None
        if stop is not None:
            return self.completion(seq, "stop", stop)
        if len(seq.token_ids) >= params.max_tokens:
            return self.completion(seq, "length", None)
        return None

    def find_stop_string(self, seq: Sequence) -> str | None:
        """The first stop string in the text so far, which is then cut there; None if there is none yet."""
        # Decoding the whole completion each step is simple and exact (a stop string may span tokens).
        text = self.detokenize(seq.token_ids, seq.params.skip_special_tokens)
        hits = [(text.find(stop), stop) for stop in seq.params.stop if stop in text]
        if not hits:
            return None
        at, stop = min(hits)
        seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
        return stop

    def completion(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> Completion:
        text = (
            seq.text
            if seq.text is not None
            else self.detokenize(seq.token_ids, seq.params.skip_special_tokens)
        )
        ends = [start for _, start in seq.version_starts[1:]] + [len(seq.token_ids)]
        spans = [(label, start, end) for (label, start), end in zip(seq.version_starts, ends)]
        kept = seq.kept_ids if seq.params.sampling_mask else None
        return Completion(
            seq.token_ids, seq.logprobs, seq.ranks, seq.top_logprobs, text, reason, stop_reason, spans, kept,
            seq.prompt_logprobs,
        )  # fmt: skip

    def select(self, batch: Batch, keep: list[int]) -> Batch:
        """Keeps the given rows, and drops the left columns that are padding in every remaining row (a
        BlockLayer's whole blocks of them)."""
        index = torch.tensor(keep, device=self.device)
        mask = batch.attention_mask[index]
        cache, start = selected(batch.cache, index, int(mask.any(dim=0).int().argmax()))
        rows = {name: getattr(batch, name)[index] for name in ROW_TENSORS}
        return Batch([batch.seqs[row] for row in keep], cache, mask[:, start:], **rows)

    def join(self, old: Batch | None, new: Batch | None) -> Batch | None:
        """One batch of both, the old rows first."""
        if old is None or new is None:
            return old or new
        cache, mask = self.stacked([(old.cache, old.attention_mask), (new.cache, new.attention_mask)])
        rows = {name: torch.cat([getattr(old, name), getattr(new, name)]) for name in ROW_TENSORS}
        return Batch(old.seqs + new.seqs, cache, mask, **rows)

    def stacked(self, parts: list[tuple[DynamicCache, torch.Tensor]]) -> tuple[DynamicCache, torch.Tensor]:
        """kv.py stacked's one (cache, mask) of several, with this model's kind of cache."""
        return stacked(self.model.config, parts, self.cache_dtype, self.blocks)

    def cache(self, layers=()) -> DynamicCache:
        """A KV cache for the model, filled with `layers`' (keys, values) when given (kv.py)."""
        return kv_cache(self.model.config, layers, self.cache_dtype, self.blocks)
