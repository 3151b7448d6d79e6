"""The output layer in chunks of tokens: per-token logprobs and entropy without a (tokens, vocabulary) tensor.

With Qwen's 151,936-row vocabulary the logits of a micro-batch are most of a GPU's memory: 4k tokens of
float32 logits are 2.5 GB, and a log-softmax with its backward keeps several such tensors. Here the
model's output layer, asked for scores (`token_scores`), computes the logits of CHUNK_TOKENS tokens at a
time, keeps only each token's logprob, entropy and log-normaliser, and recomputes a chunk's logits in
backward. Only the tokens that are scored (the loss tokens) go through the output layer at all.

The scores are computed inside the model's own forward (the output layer's forward is replaced on the
instance, so the state dict keeps its keys): under FSDP2 the output layer's weight is gathered only there.
"""

import torch

CHUNK_TOKENS = 1024
"""Tokens per chunk: 1024 x 151,936 float32 logits are 0.62 GB, and a chunk needs about three of them."""


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's matmul runs in: autocast's when it is on, as for any Linear."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,)) -> logp (N,) of each target at `temperature`, and the
    entropy (N,) of each next-token distribution (no gradient). Backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        dtype = compute_dtype(weight)
        weight_c = weight.to(dtype)
        logp, entropy, normaliser = [], [], []
        for first in range(0, hidden.shape[0], chunk):
            logits = (hidden[first : first + chunk].to(dtype) @ weight_c.t()).float() / temperature  # (n, V)
            lse = logits.logsumexp(-1)  # (n,)
            logprobs = logits.sub_(lse[:, None])  # (n, V), in place: one (n, V) tensor at a time
            logp.append(logprobs.gather(-1, targets[first : first + chunk, None]).squeeze(-1))
            entropy.append(-(logprobs.exp() * logprobs).sum(-1))
            normaliser.append(lse)
        none = hidden.new_zeros(0, dtype=torch.float32)  # a micro-batch without scored tokens
        logp, entropy, normaliser = (torch.cat(x) if x else none for x in (logp, entropy, normaliser))
        ctx.save_for_backward(hidden, weight, targets, normaliser)
        ctx.dtype, ctx.temperature, ctx.chunk = dtype, temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, normaliser = ctx.saved_tensors
        dtype, temperature, chunk = ctx.dtype, ctx.temperature, ctx.chunk
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
            probs = ((h @ weight_c.t()).float() / temperature - normaliser[first : first + chunk, None]).exp()
            grad_logits = probs.mul_(-g[:, None])  # (n, V)
            grad_logits.scatter_add_(-1, targets[first : first + chunk, None], g[:, None])
            grad_logits = grad_logits.div_(temperature).to(dtype)
            if grad_hidden is not None:
                grad_hidden[first : first + chunk] = grad_logits @ weight_c
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ h).float()
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None


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
        targets, keep, temperature = head.scoring
        logp, entropy = ChunkedTokenLogprobs.apply(
            hidden[keep], head.weight, targets[keep], temperature, CHUNK_TOKENS
        )
        scores = hidden.new_zeros((*keep.shape, 2), dtype=torch.float32)  # (B, T, 2): logp, entropy
        return scores.index_put((keep,), torch.stack([logp, entropy], -1))

    head.forward = forward


def token_scores(model, input_ids, position_ids, targets, keep, temperature: float = 1.0):
    """Per position t of (B, T) rows: log p(targets[t] | tokens <= t) at `temperature` and the entropy of that
    distribution (no gradient), both float32 (B, T), 0 where `keep` is False. The model must have been through
    use_chunked_head."""
    head = model.get_output_embeddings()
    head.scoring = (targets, keep.bool(), temperature)
    try:
        scores = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits  # (B, T, 2)
    finally:
        head.scoring = None
    return scores[..., 0], scores[..., 1]


def next_token_scores(model, input_ids, position_ids, mask, temperature: float = 1.0):
    """token_scores aligned like loss.token_logp: log p(input_ids[t] | tokens < t) and its distribution's
    entropy at position t of (B, T), 0 at position 0 and wherever `mask` (B, T) is False."""
    import torch.nn.functional as F

    targets = F.pad(input_ids[:, 1:], (0, 1))  # position t's hidden state predicts token t + 1
    keep = F.pad(mask[:, 1:].bool(), (0, 1))
    logp, entropy = token_scores(model, input_ids, position_ids, targets, keep, temperature)
    return F.pad(logp[:, :-1], (1, 0)), F.pad(entropy[:, :-1], (1, 0))
