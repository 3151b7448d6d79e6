"""The builtin engine's prompt_logprobs: each prompt token's logprob under the model, as vLLM 0.32 computes them."""

import torch

# Prompt tokens scored per output-layer call: (CHUNK, vocabulary) float32 logprobs at a time, not (prompt, vocabulary).
CHUNK = 1024


def prompt_logprobs(model, hidden, prompt_ids: list[int], k: int) -> list[list[tuple[int, float, int]]]:
    """Per prompt token after the first, vLLM's entries for it: (token, logprob, rank) of the token itself,
    then of the k most likely ones (each token once). `hidden` (T, H): the model's last hidden state at each
    prompt position (the prefill's, decode.py).

    As vLLM 0.32 (vllm/v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict): the model's raw distribution,
    log_softmax in float32 of the logits the model computes; prompt tokens skip the sampling processors, so
    no temperature, top-k or top-p touches them, whatever the request asks.
    """
    head = model.get_output_embeddings()
    targets, hidden = torch.tensor(prompt_ids[1:], device=hidden.device), hidden[:-1]  # (T-1,), (T-1, H)
    entries = []
    for first in range(0, len(targets), CHUNK):
        logp = head(hidden[first : first + CHUNK]).float().log_softmax(-1)  # (n, V)
        target = targets[first : first + CHUNK, None]  # (n, 1)
        chosen = logp.gather(-1, target)  # (n, 1)
        ranks = (logp > chosen).sum(-1) + 1  # (n,)
        top_values, top_ids = logp.topk(k, dim=-1) if k else (chosen[:, :0], target[:, :0])  # (n, k)
        for token, value, rank, others, values in zip(
            target[:, 0].tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
        ):
            listed = [(token, value, rank)]
            listed += [(o, v, r + 1) for r, (o, v) in enumerate(zip(others, values)) if o != token]
            entries.append(listed[: k + 1])
    return entries
