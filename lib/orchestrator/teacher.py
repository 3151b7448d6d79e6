"""On-policy distillation's teacher: its settings, the check that it shares the student's tokenizer, and the
client that scores each rollout's tokens (vLLM's prompt_logprobs on /v1/completions) beside sampling."""

import asyncio
import dataclasses
import itertools
import time

import httpx

from lib import endpoint
from lib.config import UserError

# A scoring request's backstop: a frozen teacher is found sooner by check(), which take() runs every HEALTH_EVERY_S.
SCORE_TIMEOUT_S = 600.0


@dataclasses.dataclass
class TeacherConfig:
    model: str = ""
    """The teacher of on-policy distillation (a hub id or a local Hugging Face directory): rl.py starts its server
    as it starts the policy's (inference.engine, the key, teacher.log in the run directory), and every rollout's
    tokens are scored by it (docs/algorithms.md). With teacher.urls: where its tokenizer is. Empty, with no
    urls: no teacher."""
    urls: list[str] = dataclasses.field(default_factory=list)
    """Attach to these teacher servers (base URLs ending in /v1), the key from $PLAINRL_API_KEY as for the
    policy's; rollouts are scored on them in turn."""

    def __post_init__(self):
        for url in self.urls:
            endpoint.check_base_url(url, "teacher.urls")

    @property
    def enabled(self) -> bool:
        return bool(self.model or self.urls)


def check_teacher(cfg) -> None:
    """rl.py's distillation settings (cfg: its Config), before any server starts: a reward weight needs a teacher,
    and a teacher given as teacher.model must share the student's tokenizer (an attached one: launch.open_teacher)."""
    if cfg.distill.reward_weight and not cfg.teacher.enabled:
        raise UserError(
            "distill.reward_weight weighs the reward beside a teacher: give --teacher.model or --teacher.urls."
        )
    check_tokenizer(cfg.model.name, cfg.teacher.model)


def check_tokenizer(student: str, teacher: str | None) -> None:
    """A one-sentence UserError unless the teacher's tokenizer gives every token the student's id: the teacher
    scores the student's token ids as they are. No teacher (None): nothing to check."""
    from lib.models.load import load_tokenizer

    if not teacher:
        return
    try:
        theirs = load_tokenizer(teacher).get_vocab()
    except (OSError, ValueError):
        raise UserError(
            f"cannot load the teacher's tokenizer from {teacher} to check it against the student's "
            f"({student}): give --teacher.model the teacher's local directory"
        ) from None
    ours = load_tokenizer(student).get_vocab()
    differ = sum(ours.get(token) != index for token, index in theirs.items()) + len(
        ours.keys() - theirs.keys()
    )
    if differ:
        raise UserError(
            f"the teacher {teacher} has another tokenizer than the student {student} ({differ} of "
            f"{max(len(ours), len(theirs))} tokens differ), and distillation scores the student's token ids "
            "with the teacher: give both the same tokenizer"
        )


class Teacher:
    """Scores rollouts on the teacher's servers, one request per rollout, the servers in turn; used from the
    producer's event loop, which also keeps its busy time (the seconds at least one request was in flight)."""

    def __init__(self, urls: list[str], names: list[str], api_key: str | None):
        assert urls and len(urls) == len(names), "a teacher needs its servers and the name each answers to"
        self.urls, self.names, self.api_key = urls, names, api_key
        self.turn = itertools.cycle(range(len(urls)))
        self.in_flight, self.busy_since, self.busy_seconds = 0, 0.0, 0.0

    def busy(self) -> float:
        """Seconds the teacher has been scoring since it started, the request in flight included."""
        return self.busy_seconds + (time.monotonic() - self.busy_since if self.in_flight else 0.0)

    async def score(self, http: httpx.AsyncClient, token_ids: list[int]) -> list[float]:
        """The teacher's logprob of each token given those before it (0 for the first): vLLM's prompt_logprobs
        of the whole sequence as a token-id prompt, one token generated (vLLM asks for at least one)."""
        index = next(self.turn)
        url, root = self.urls[index], endpoint.root_url(self.urls[index])
        body = {"model": self.names[index], "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
        with endpoint.reaching(f"the teacher server {root}", "score a rollout", SCORE_TIMEOUT_S):
            response = await http.post(f"{url}/completions", json=body)
        if response.status_code != 200:
            raise UserError(
                f"the teacher server {root} refused to score a rollout of {len(token_ids)} tokens "
                f"({response.status_code}: {response.text[:300]})"
            )
        entries = response.json()["choices"][0]["prompt_logprobs"]
        return [0.0] + [entry[str(token)]["logprob"] for token, entry in zip(token_ids[1:], entries[1:])]

    async def score_group(self, group: list) -> list:
        """The group's rollouts with their teacher_logp, scored side by side."""
        if not self.in_flight:
            self.busy_since = time.monotonic()
        self.in_flight += 1
        try:
            async with httpx.AsyncClient(
                headers=endpoint.headers(self.api_key), timeout=SCORE_TIMEOUT_S, verify=endpoint.ssl_context()
            ) as http:
                scores = await asyncio.gather(*(self.score(http, r.token_ids) for r in group))
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.busy_seconds += time.monotonic() - self.busy_since
        return [dataclasses.replace(r, teacher_logp=s) for r, s in zip(group, scores)]

    def check(self) -> None:
        """Every teacher server answers /health (rl.py runs it while it waits for rollouts): a dead or frozen
        one ends the run in seconds, with one sentence."""
        try:
            endpoint.check_servers(self.urls, self.api_key)
        except UserError as error:
            raise UserError(f"the teacher stopped answering: {error}") from None
