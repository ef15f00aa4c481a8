"""Resuming an OpenAI generation (completions or chat, streamed or not, any n) on another router replica when the one
serving it dies: the HTTP front's counterpart of router_service/continuation.py. Pure (no Ray, no HTTP): the front
(http_front.py, through router_service/resuming.py) relays the deployment's events and records them here; this
builds the request that continues from what was relayed.

The deployment streams plain dicts, each naming its choice `index` (router_service/openai_responses.py): echo, token,
done. After a lost call the job is re-sent with, per choice, the token ids already relayed (`resumed`), the choices
whose echo and whose done were relayed (`echoed`, `finished`): the router re-prefills prompt + those tokens and
continues after them (batching.py `resumed_ids`), counting them toward max_tokens and usage and not streaming them
again; it skips echoes and choices already relayed. Greedy output is then identical, and so is sampled output given
a seed (sampling.skip_draws), which is why a sampled job without one gets one here, before its first attempt.

best_of > n cannot resume mid-way: its candidates are ranked only at their end, and the deployment streams nothing
before that. Such a job is re-sent whole; a seeded rerun produces the same events, and any the lost call had already
relayed are dropped (`fresh`), so the client still sees each once.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from .openai_api import OpenAIJob

SEED_LIMIT = 2**63  # SamplingParams takes [0, 2^63); choice j samples with (seed + j) mod 2^63


def with_resumable_seed(job: OpenAIJob) -> OpenAIJob:
    """The job, with a random seed when it samples without one, so a resumed request draws what the lost one would
    have (an unseeded job is random either way; the client sees no difference)."""
    if job.temperature == 0 or job.seed is not None:
        return job
    return replace(job, seed=secrets.randbelow(SEED_LIMIT))


class OpenAIProgress:
    """What one OpenAI request's calls have relayed to the front, per choice, and the job that continues from there."""

    def __init__(self, job: OpenAIJob):
        self.job = job
        self.delivered: dict[int, list[int]] = {}  # choice index -> token ids relayed, in order
        self.echoed: set[int] = set()
        self.finished: set[int] = set()
        self.events = 0  # events relayed: the progress a resume streak counts (resume_streak.py)
        # A re-sent whole job (best_of) replays what was relayed: per choice, what is still to drop.
        self._replay_tokens: dict[int, int] = {}
        self._replay_echo: set[int] = set()
        self._replay_done: set[int] = set()

    @property
    def done(self) -> bool:
        """Every choice's final event was relayed: nothing is left to resume."""
        return len(self.finished) == self.job.num_choices

    @property
    def resumable(self) -> bool:
        """Can the router continue this job mid-way (else it is re-sent whole and the replay dropped)?"""
        return self.job.best_of is None

    def record(self, event: dict) -> None:
        """Call for each event the front relays (after `fresh` said it is new)."""
        kind, body = next(iter(event.items()))
        index = body.get("index", 0)
        self.events += 1
        if kind == "echo":
            self.echoed.add(index)
        elif kind == "token":
            self.delivered.setdefault(index, []).extend(body["ids"])
        elif kind == "done":
            self.finished.add(index)

    def fresh(self, event: dict) -> bool:
        """False for an event a re-sent whole job replays (the lost call relayed it already); True otherwise."""
        kind, body = next(iter(event.items()))
        index = body.get("index", 0)
        if kind == "echo" and index in self._replay_echo:
            self._replay_echo.discard(index)
            return False
        if kind == "token" and self._replay_tokens.get(index, 0) > 0:
            # A replayed token event carries the ids the lost call's did (both are the same seeded run).
            self._replay_tokens[index] -= len(body["ids"])
            return False
        if kind == "done" and index in self._replay_done:
            self._replay_done.discard(index)
            return False
        return True

    def next_job(self) -> OpenAIJob:
        """The job to send now: the original until an event was relayed, then one that continues after them."""
        if not self.events:
            return self.job
        if not self.resumable:
            self._replay_tokens = {i: len(ids) for i, ids in self.delivered.items()}
            self._replay_echo, self._replay_done = set(self.echoed), set(self.finished)
            return self.job
        choices = self.job.num_choices
        return replace(self.job, resumed=tuple(tuple(self.delivered.get(i, ())) for i in range(choices)),
                       echoed=tuple(sorted(self.echoed)), finished=tuple(sorted(self.finished)))
