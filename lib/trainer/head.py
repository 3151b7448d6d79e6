"""The output layer in chunks of tokens: per-token logprobs and entropy without a (tokens, vocabulary) tensor.

With Qwen's 151,936-row vocabulary the logits of a micro-batch are most of a GPU's memory: 4k tokens of
float32 logits are 2.5 GB, and a log-softmax with its backward keeps several such tensors. Here the
model's output layer, asked for scores (`token_scores`), computes the logits of CHUNK_TOKENS tokens at a
time, keeps only each token's logprob, entropy and log-normaliser, and recomputes a chunk's logits in
backward. Only the tokens that are scored (the loss tokens) go through the output layer at all.

With top-k/top-p sampling a token's logprob is renormalised over its kept set (KeptSets): the ids the
server's filter left, served with the rollout or recomputed here from the trainer's logits by the server's
rules. A chunk then holds one (n, V) bool mask more, and its kept ids are saved for backward.

The scores are computed inside the model's own forward (the output layer's forward is replaced on the
instance, so the state dict keeps its keys): under FSDP2 the output layer's weight is gathered only there.
"""

import dataclasses

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 1024
"""Tokens per chunk: 1024 x 151,936 float32 logits are 0.62 GB, and a chunk needs about three of them."""
KEPT_ELEMENTS = 1 << 24
"""Logits whose kept sets are recomputed at a time (a whole number of rows, at least one): bounds
lib/sampling.py kept_mask's (rows, V) temporaries, 64 MB each in float32 (110 rows of Qwen's vocabulary)."""


@dataclasses.dataclass
class KeptSets:
    """Each scored token's kept set: the ids top-k/top-p left when it was sampled, which its logprob is
    renormalised over. Served by the engine (`ids`, `counts`: vLLM's --return-sampling-mask, or the builtin
    engine's), or recomputed from the trainer's own logits at `top_k`/`top_p` by vLLM's CPU rules
    (lib/sampling.py kept_mask). A token outside its recomputed set scores -inf: its probability there is 0."""

    top_k: int = -1
    """Recomputed: the sampling's top_k (-1 = off)."""
    top_p: float = 1.0
    """Recomputed: the sampling's top_p (1 = off)."""
    ids: torch.Tensor | None = None
    """Served: the kept ids of every token, one token after the other in row-major order (int32); None = recompute."""
    counts: torch.Tensor | None = None
    """Served: how many kept ids each token has (int32), shaped like the tokens; 0 off the sampled tokens."""

    @property
    def served(self) -> bool:
        return self.ids is not None

    def select(self, rows: torch.Tensor) -> "KeptSets":
        """Served sets of the tokens where `rows` (shaped like counts) is True, in row-major order; counts (N,)."""
        if not self.served:
            return self
        counts = self.counts.flatten().long()  # (B * T,)
        starts = F.pad(counts.cumsum(0), (1, 0))[:-1]  # (B * T,) where each token's ids begin
        picked = counts[rows.flatten()]  # (N,)
        begin = F.pad(picked.cumsum(0), (1, 0))[:-1]  # (N,) where they begin once selected
        within = torch.arange(int(picked.sum()), device=counts.device) - begin.repeat_interleave(picked)
        ids = self.ids[starts[rows.flatten()].repeat_interleave(picked) + within]  # (K,)
        return KeptSets(ids=ids, counts=picked.int())


def kept_in_chunk(logits, kept: KeptSets, first: int, offsets: list[int] | None):
    """(n, V) bool: the kept sets of a chunk's rows, rows first.. of the KeptSets' (`offsets`: row_offsets of
    served counts). Recomputed from `logits` (float32, divided by the temperature)."""
    from lib.sampling import kept_mask

    n, vocab = logits.shape
    if kept.served:
        rows = torch.arange(n, device=logits.device).repeat_interleave(kept.counts[first : first + n].long())
        allowed = torch.zeros((n, vocab), dtype=torch.bool, device=logits.device)
        allowed[rows, kept.ids[offsets[first] : offsets[first + n]].long()] = True
    else:
        top_k = torch.full((n,), kept.top_k, device=logits.device) if kept.top_k > 0 else None
        top_p = torch.full((n,), kept.top_p, device=logits.device) if kept.top_p < 1 else None
        rows = max(1, KEPT_ELEMENTS // vocab)
        allowed = torch.cat(
            [
                kept_mask(
                    logits[s : s + rows],
                    None if top_k is None else top_k[s : s + rows],
                    None if top_p is None else top_p[s : s + rows],
                )
                for s in range(0, n, rows)
            ]
        )  # (n, V)
    return allowed


def row_offsets(counts: torch.Tensor) -> list[int]:
    """Where each row's ids begin in the flat ids, and the end: (N + 1) ints."""
    return F.pad(counts.long().cumsum(0), (1, 0)).tolist()


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's matmul runs in: autocast's when it is on, as for any Linear."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,)) -> logp (N,) of each target at `temperature`, and the
    entropy (N,) of each next-token distribution. Backward recomputes each chunk's logits (and takes the
    entropy's gradient, for an entropy bonus, from the same recomputed chunk).
    With `kept` (KeptSets, one row per hidden row), both are of the distribution renormalised over the kept set,
    the one the server sampled from: logp = logit / temperature - logsumexp over the kept ids."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, kept: KeptSets | None = None):
        dtype = compute_dtype(weight)
        weight_c = weight.to(dtype)
        logp, entropy, normaliser, kept_ids, kept_counts = [], [], [], [], []
        offsets = row_offsets(kept.counts) if kept is not None and kept.served else None
        for first in range(0, hidden.shape[0], chunk):
            logits = (hidden[first : first + chunk].to(dtype) @ weight_c.t()).float()  # (n, V)
            # In place, and not at all at 1: on a CPU each (n, V) pass and each fresh (n, V) buffer weighs on
            # the step (SmolLM2-135M, 1024 tokens: this head's CPU time 2.17 -> 1.49 s in bf16, 3.14 -> 2.51 s
            # in float32, from in-place passes here and in backward).
            if temperature != 1:
                logits.div_(temperature)
            if kept is not None:  # outside the kept set a token has probability 0: logp -inf
                allowed = kept_in_chunk(logits, kept, first, offsets)  # (n, V)
                logits.masked_fill_(~allowed, float("-inf"))
                if kept.served:  # backward rebuilds the masks from the ids
                    last = first + logits.shape[0]
                    kept_ids.append(kept.ids[offsets[first] : offsets[last]])
                    kept_counts.append(kept.counts[first:last])
                else:
                    kept_ids.append(allowed.nonzero()[:, 1].int())  # (k,)
                    kept_counts.append(allowed.sum(-1, dtype=torch.int32))  # (n,)
            lse = logits.logsumexp(-1)  # (n,)
            logprobs = logits.sub_(lse[:, None])  # (n, V), in place: one (n, V) tensor at a time
            # 0 * -inf = nan outside the kept set, where it is 0.
            plogp = logprobs.exp().mul_(logprobs)  # (n, V)
            if kept is not None:
                plogp = plogp.nan_to_num_(nan=0.0)
            logp.append(logprobs.gather(-1, targets[first : first + chunk, None]).squeeze(-1))
            entropy.append(-plogp.sum(-1))
            normaliser.append(lse)
        # A micro-batch without scored tokens (a rank's padding one) gets three tensors, not one: an autograd
        # Function's two outputs must be two tensors, and logp keeps its gradient for the backward every rank runs.
        logp, entropy, normaliser = (
            torch.cat(x) if x else hidden.new_zeros(0, dtype=torch.float32)
            for x in (logp, entropy, normaliser)
        )
        if kept is None:
            kept_ids = kept_counts = None
        else:
            empty = torch.zeros(0, dtype=torch.int32, device=hidden.device)
            kept_ids, kept_counts = (torch.cat(x) if x else empty for x in (kept_ids, kept_counts))
        ctx.save_for_backward(hidden, weight, targets, normaliser, entropy, kept_ids, kept_counts)
        ctx.dtype, ctx.temperature, ctx.chunk = dtype, temperature, chunk
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None in backward
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, normaliser, entropy, kept_ids, kept_counts = ctx.saved_tensors
        dtype, temperature, chunk = ctx.dtype, ctx.temperature, ctx.chunk
        if grad_logp is None:
            grad_logp = torch.zeros_like(normaliser)
        # The entropy's gradient costs one (n, V) operation more per chunk: only with an entropy bonus (without
        # one the entropy reaches the loss nowhere, and its gradient is None or, through the scores' stack, 0).
        with_entropy = grad_entropy is not None and bool(grad_entropy.any())
        kept = None if kept_ids is None else KeptSets(ids=kept_ids, counts=kept_counts)
        offsets = row_offsets(kept_counts) if kept is not None else None
        weight_c = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # A frozen output layer (LoRA) gets no float32 (V, H) buffer: 0.58 GiB at Qwen3-0.6B, 1.45 at Qwen3-4B.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for first in range(0, hidden.shape[0], chunk):
            h = hidden[first : first + chunk].to(dtype)  # (n, H)
            g = grad_logp[first : first + chunk].float()  # (n,)
            # d logp / d logits = onehot(target) - softmax, through the division by the temperature.
            lse = normaliser[first : first + chunk, None]  # (n, 1)
            logprobs = (h @ weight_c.t()).float()  # (n, V)
            if temperature != 1:
                logprobs.div_(temperature)
            logprobs.sub_(lse)
            # Only the entropy's gradient reads logprobs again: without it, the probabilities take its place.
            probs = logprobs.exp() if with_entropy else logprobs.exp_()  # (n, V)
            if not with_entropy:
                del logprobs
            if kept is not None:  # the softmax over the kept set only: 0 elsewhere
                probs.masked_fill_(~kept_in_chunk(probs, kept, first, offsets), 0.0)
            if with_entropy:
                # d H / d logits = -p * (log p + H) per row, so the chunk's gradient is onehot(target) * g
                # - p * (g + g_H * (log p + H)); outside a kept set p = 0 and log p stays finite here.
                g_entropy = grad_entropy[first : first + chunk, None].float()  # (n, 1)
                rows = logprobs.add_(entropy[first : first + chunk, None]).mul_(g_entropy)  # (n, V), in place
                grad_logits = probs.mul_(rows.add_(g[:, None])).neg_()  # (n, V)
                del rows, logprobs
            else:
                grad_logits = probs.mul_(-g[:, None])  # (n, V)
            grad_logits.scatter_add_(-1, targets[first : first + chunk, None], g[:, None])
            if temperature != 1:
                grad_logits.div_(temperature)
            grad_logits = grad_logits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[first : first + chunk] = grad_logits @ weight_c
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ h).float()
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None


def use_chunked_head(model) -> None:
    """Lets the model's output layer answer `token_scores`; otherwise (generation, the probe) it is unchanged."""
    head = model.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.bias is None, (
        f"a chunked head needs a plain Linear, not {head}"
    )
    plain_forward = head.forward
    head.scoring = None

    def forward(hidden):
        if head.scoring is None:
            return plain_forward(hidden)
        sources, targets, place, temperature, kept = head.scoring
        logp, entropy = ChunkedTokenLogprobs.apply(
            hidden.flatten(0, 1)[sources], head.weight, targets, temperature, CHUNK_TOKENS, kept
        )
        scores = hidden.new_zeros((*place.shape, 2), dtype=torch.float32)  # (B, T, 2): logp, entropy
        return scores.index_put((place,), torch.stack([logp, entropy], -1))

    head.forward = forward


def token_scores(
    model, input_ids, position_ids, targets, keep, temperature: float = 1.0, kept: KeptSets | None = None
):
    """Per position t of (B, T) rows: log p(targets[t] | tokens <= t) at `temperature` and the entropy of that
    distribution, both float32 with gradients (B, T), 0 where `keep` is False; `kept` (served: one row per True
    of `keep`) renormalises both over each token's kept set. The model must have been through
    use_chunked_head; next_token_scores is the entry point."""
    keep = keep.bool()
    sources = keep.flatten().nonzero().squeeze(1)  # (n,) each kept position scores from its own hidden state
    return scored(
        model, input_ids, position_ids, sources, targets[keep], place=keep, temperature=temperature, kept=kept
    )


def scored(model, input_ids, position_ids, sources, targets, place, temperature, kept, bounds=None):
    """The forward behind token_scores: the hidden states at flat positions `sources` (n,) score `targets`
    (n,), and the scores land where `place` (B, T) is True, in row-major order (B, T) each."""
    from lib.models.attention import sequence_bounds

    head = model.get_output_embeddings()
    assert hasattr(head, "scoring"), "score tokens with a model that went through use_chunked_head"
    # Read by the forward use_chunked_head installed; the bounds, once for every layer (lib/models/attention.py).
    head.scoring = (sources, targets, place, temperature, kept)
    bounds = bounds or sequence_bounds(position_ids, *input_ids.shape)
    try:
        scores = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, packed_bounds=bounds
        ).logits  # (B, T, 2)
    finally:
        head.scoring = None
    return scores[..., 0], scores[..., 1]


def micro_batch_kept_sets(mode: str, sampling, mb) -> KeptSets | None:
    """The kept sets a micro-batch's tokens were sampled from, by rl.py's kept-set `mode` (None: the full
    vocabulary). `sampling` is the run's, bounded (lib/sampling.py)."""
    if mode == "recomputed":
        return KeptSets(top_k=sampling.top_k, top_p=sampling.top_p)
    if mode == "served" and mb.kept_ids is not None:  # None: a padding micro-batch, no loss
        return KeptSets(ids=mb.kept_ids, counts=mb.kept_counts)
    return None


class Reference:
    """loss.kl_coef's reference: the run's starting weights, scored without gradient. Under LoRA it is the
    policy with its adapter off (`frozen` None: no memory, no parameters); full fine-tuning passes a frozen
    copy loaded as the policy was (float32 master weights, the chunked head, FSDP2-sharded over the ranks)."""

    def __init__(self, policy, frozen, autocast, temperature: float):
        self.policy, self.frozen, self.autocast, self.temperature = policy, frozen, autocast, temperature

    def logp(self, mb, kept: KeptSets | None) -> torch.Tensor:
        """The reference's logprobs of mb's loss tokens (R, T), of the distribution the policy's are of: the
        sampling temperature, and each token's kept set when top-k/top-p filtered it (served: the same ids as
        the policy's; recomputed: the same rule, on the reference's own logits)."""
        import contextlib

        adapter_off = self.policy.disable_adapter() if self.frozen is None else contextlib.nullcontext()
        with torch.no_grad(), self.autocast(), adapter_off:
            model = self.policy if self.frozen is None else self.frozen
            ref_logp, _ = next_token_scores(
                model, mb.input_ids, mb.position_ids, mb.loss_mask, self.temperature, kept
            )  # (R, T)
        return ref_logp


def next_token_scores(
    model, input_ids, position_ids, mask, temperature: float = 1.0, kept: KeptSets | None = None
):
    """The one convention for scoring tokens (SFT, RL and the sync probe): at position t of (B, T) rows,
    log p(input_ids[t] | tokens < t) at `temperature` and its distribution's entropy, float32, 0 at position
    0 and wherever `mask` (B, T) is False; `mask` marks the tokens to train on (lib/trainer/packing.py). A shared
    prompt's branch (lib/trainer/packing.py shared_prompts) predicts its first token from the prompt's last. With
    `kept` (served counts (B, T), at each sampled token's position) both are over each token's kept set,
    and a token outside its recomputed set scores -inf."""
    from lib.models.attention import previous_tokens, sequence_bounds

    place = F.pad(mask[:, 1:].bool(), (1, 0))  # (B, T): position 0 has no token before it
    bounds = sequence_bounds(position_ids, *input_ids.shape)
    sources = previous_tokens(bounds, *input_ids.shape, input_ids.device)[place.flatten()]  # (n,)
    if kept is not None:  # served: the sets of the scored tokens, in row-major order
        kept = kept.select(place)
    targets = input_ids[place]  # (n,)
    return scored(
        model,
        input_ids,
        position_ids,
        sources,
        targets,
        place,
        temperature=temperature,
        kept=kept,
        bounds=bounds,
    )
