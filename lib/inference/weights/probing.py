"""The logprob probe: a few tokens sampled by a server from a fixed prompt, scored by the trainer too, to check
that the server serves the trainer's weights (label, model, dtype, chat template, logprobs mode, adapter)."""

import dataclasses

import httpx

from lib.config import UserError
from lib.endpoint import headers, root_url, ssl_context
from lib.inference.weights import reload

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"
PROBE_TEMPERATURE = 0.5
PROBE_TOKENS = 8
# Provisional, from CPU only (benchmarks/inference/bench_probe_tolerance.py, Qwen3-0.6B shape, both engines
# serving bf16, the trainer's float32 weights in float32 and under bf16 autocast): the mean |logprob difference| over 8
# probe tokens reached 0.125 on one prompt, and 0.045 averaged over 6 prompts, when the sampled tokens had
# probabilities around 0.06 (log -2.8), the most sensitive regime; random, briefly trained and very peaked
# models gave 0.003-0.023 on average. Twice the worst prompt, until GPU kernels are measured. So loose that
# a server left on the last step's weights passes it at real learning rates: what proves the weights is the
# fingerprint (lib/inference/weights/reload.py check_fingerprint); the probe stays for what it alone sees (another model, chat template,
# logprobs mode, a LoRA adapter not applied).
BF16_PROBE_TOLERANCE = 0.25


@dataclasses.dataclass
class Probe:
    """What one server sampled for the probe prompt."""

    url: str
    completion_ids: list[int]
    logprobs: list[float]
    label: str | None
    """The weight label of the answer (None when the server reports none)."""
    kept: list[list[int]] | None = None
    """Each token's kept ids, when the server returns them (`sampling_mask`)."""


def probe(
    url: str, model: str, prompt_ids: list[int], api_key: str | None, top_k: int = -1, top_p: float = 1.0
) -> Probe:
    """PROBE_TOKENS tokens of `prompt_ids`, sampled at PROBE_TEMPERATURE with a fixed seed and the run's
    top_k/top_p (a server started with --return-sampling-mask refuses a request without top_k), and their
    logprobs.

    The trainer scores the same tokens (compare): the label must be the new one and the mean logprob
    difference small. That also catches, at the start of a run, a server with another model, dtype, chat
    template or logprobs mode (raw logprobs differ from the tempered ones the probe asks for)."""
    params = {"max_tokens": PROBE_TOKENS, "temperature": PROBE_TEMPERATURE, "logprobs": 0, "seed": 0}
    if top_k > 0:
        params["top_k"] = top_k
    if top_p < 1:
        params["top_p"] = top_p
    body = {"model": model, "token_ids": prompt_ids, "sampling_params": params | {"ignore_eos": True}}
    with httpx.Client(headers=headers(api_key), verify=ssl_context()) as http:
        answer = reload.post(http, url, "/inference/v1/generate", json=body)
    choice = answer["choices"][0]
    spans = choice.get("weight_versions") or []
    return Probe(
        url,
        list(choice["token_ids"]),
        [entry["logprob"] for entry in choice["logprobs"]["content"]],
        spans[-1]["version"] if spans else None,
        choice.get("sampling_mask"),
    )


def check_label(probe: Probe, label: str, when: str) -> None:
    """A UserError when the server reports other weights than `label` (one that reports none passes)."""
    if probe.label is not None and probe.label != label:
        raise UserError(
            f"the inference server {root_url(probe.url)} serves weights {probe.label!r} {when}, not {label!r}: "
            "it did not take the new weights"
        )


def compare(probe: Probe, trainer_logprobs: list[float], label: str, tolerance: float, when: str) -> float:
    """The mean |logprob difference| between a server and the trainer; ValueError past `tolerance` or when
    the server reports other weights than `label`."""
    check_label(probe, label, when)
    difference = sum(abs(a - b) for a, b in zip(probe.logprobs, trainer_logprobs)) / len(trainer_logprobs)
    if difference > tolerance:
        raise UserError(
            f"the inference server {root_url(probe.url)} disagrees with the trainer {when}: mean |logprob "
            f"difference| {difference:.3g} > inference.probe_tolerance {tolerance} on the same tokens; was it "
            "started with another model, dtype, chat template or logprobs mode (vLLM needs "
            "--logprobs-mode processed_logprobs)?"
        )
    return difference


def trainer_logprobs(
    model, autocast, prompt_ids: list[int], completion_ids: list[int], kept=None
) -> list[float]:
    """The trainer's logprobs of a probe's `completion_ids` after `prompt_ids`, at PROBE_TEMPERATURE, scored as
    training scores tokens (next_token_scores), over the kept sets `kept` (lib/trainer/head.py KeptSets, served counts
    (1, T)) when the run samples with top-k/top-p. Every rank calls it with the same tokens: under FSDP the
    forward is collective."""
    import torch

    from lib.trainer.head import next_token_scores

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=device)  # (1, T)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, len(prompt_ids) :] = True
    with torch.no_grad(), autocast():
        positions = torch.arange(ids.shape[1], device=device)[None]
        logp, _ = next_token_scores(model, ids, positions, mask, PROBE_TEMPERATURE, kept)
    return logp[0, len(prompt_ids) :].tolist()


def probe_kept_sets(servers, answer: Probe, prompt_length: int):
    """The kept sets the trainer scores a probe's tokens over, as training does (lib/trainer/head.py KeptSets): the
    server's (served), the trainer's own (recomputed), or None without top-k/top-p. `servers`: sync.Servers."""
    import torch

    from lib.trainer.head import KeptSets

    if servers.kept_set == "recomputed":
        return KeptSets(top_k=servers.top_k, top_p=servers.top_p)
    if servers.kept_set != "served":
        return None
    if answer.kept is None:
        raise UserError(
            f"the inference server {root_url(answer.url)} returned no kept sets (sampling_mask): start it with "
            "--return-sampling-mask (vLLM on GPUs, or the builtin engine), or pass --kept-set recomputed"
        )
    counts = torch.zeros(1, prompt_length + len(answer.kept), dtype=torch.int32)  # (1, T)
    counts[0, prompt_length:] = torch.tensor([len(ids) for ids in answer.kept], dtype=torch.int32)
    ids = torch.tensor([i for ids in answer.kept for i in ids], dtype=torch.int32)
    return KeptSets(ids=ids, counts=counts)
