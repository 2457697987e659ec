"""Beam search over the paged KV cache (torch-free).

A beam-search request runs as a group of ordinary engine requests, one per
live beam. Each step every beam decodes one token and returns its top
``k = max(2, 1 + number of stop ids) * beam_width`` log-probabilities. When
every live beam of a group has reported, the group picks the next beams the
way transformers' ``generate(num_beams=...)`` does (same candidate count,
length penalty, ``early_stopping`` heuristics) and rebuilds them as forks of
their parents: a child shares every block of its parent by reference count and
copies only the partly filled last block when it writes into it
(copy-on-write in ``KVCacheManager``). Beams that no child continues are freed.

Only beam requests pass through here; the per-step path of other requests is
untouched apart from one dictionary lookup per sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus, TokenSample
from shared.engine.scheduler import Scheduler

_NEG_INF = float("-inf")


@dataclass
class Beam:
    request: Request
    score: float  # cumulative log-probability of the generated tokens
    logprobs: list[float] = field(default_factory=list)  # per generated token, the last one included


@dataclass
class Hypothesis:
    """A finished beam: its tokens and its length-penalised score."""

    token_ids: list[int]
    logprobs: list[float]
    score: float
    finish_reason: str  # "stop" (a stop/EOS token ended it) or "length"


@dataclass
class BeamGroup:
    request_id: str
    width: int
    num_returned: int
    max_new_tokens: int
    stop_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    num_candidates: int
    num_prompt_tokens: int
    beams: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    reported: dict[str, TokenSample] = field(default_factory=dict)  # beam request id -> this step's sample
    improvement_possible: bool = True
    num_cached_tokens: int = 0
    next_beam_id: int = 0

    @property
    def is_full(self) -> bool:
        return len(self.finished) >= self.width

    @property
    def results(self) -> list[Hypothesis]:
        return self.finished[: self.num_returned]


def stop_token_ids(request: Request) -> frozenset[int]:
    params = request.sampling_params
    eos = frozenset() if params.ignore_eos else request.eos_token_ids
    return eos | frozenset(params.stop_token_ids)


class BeamSearch:
    """The beam-search groups of one engine, driven from ``EngineCore.step``."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.groups: dict[str, BeamGroup] = {}
        self._beam_group: dict[str, BeamGroup] = {}  # beam request id -> its group

    def start(self, request: Request) -> Request:
        """Turn a validated beam-search request into the group's first beam (queue it yourself)."""
        params = request.sampling_params
        width = params.beam_width
        stops = stop_token_ids(request)
        num_candidates = max(2, 1 + len(stops)) * width
        # The engine must neither stop a beam nor pick its token: the group decides both.
        beam_params = replace(params, ignore_eos=True, stop_token_ids=[], max_tokens=None, temperature=0.0)
        beam_params.logprobs = num_candidates  # internal: may exceed the user-facing limit of 20
        group = BeamGroup(
            request_id=request.request_id,
            width=width,
            num_returned=params.n,
            max_new_tokens=request.max_tokens,
            stop_ids=stops,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            num_candidates=num_candidates,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        request.sampling_params = beam_params
        group.beams = [Beam(request, 0.0)]
        self.groups[group.request_id] = group
        self._beam_group[request.request_id] = group
        return request

    def owns(self, request_id: str) -> bool:
        return request_id in self._beam_group

    def report(self, request: Request, sample: TokenSample) -> None:
        """A beam sampled this step: park it until its siblings have reported too."""
        group = self._beam_group[request.request_id]
        group.reported[request.request_id] = sample
        group.num_cached_tokens = max(group.num_cached_tokens, request.num_cached_tokens)
        if request in self.scheduler.running:
            self.scheduler.running.remove(request)  # no decode on a token the group may replace

    def resolve(self) -> tuple[list[BeamGroup], list[str]]:
        """Advance every group whose beams have all reported.

        Returns the groups that finished and the request ids of the beams that
        left the engine (the caller drops their per-request runner state).
        """
        done: list[BeamGroup] = []
        released: list[str] = []
        for group in list(self.groups.values()):
            if len(group.reported) < len(group.beams):
                continue
            next_beams = self._advance(group)
            released += self._rebuild(group, next_beams)
            if not group.beams:
                done.append(group)
                del self.groups[group.request_id]
        return done, released

    def abort(self, request_id: str) -> list[str] | None:
        """End a group early; returns its beams' request ids, or None if no group has this id."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        released = [beam.request.request_id for beam in group.beams]
        for beam in group.beams:
            self._drop(beam.request)
        group.beams = []
        return released

    # ---- one step of the search --------------------------------------------------------------

    def _advance(self, group: BeamGroup) -> list[tuple[float, int, int, float]]:
        """Update finished hypotheses; returns the next running beams as (score, parent, token, logprob)."""
        candidates: list[tuple[float, int, int, float]] = []  # (cumulative score, beam index, token, logprob)
        for index, beam in enumerate(group.beams):
            sample = group.reported[beam.request.request_id]
            for token_id, logprob in sample.top_logprobs or [(sample.token_id, sample.logprob)]:
                candidates.append((beam.score + logprob, index, token_id, logprob))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: group.num_candidates]
        num_generated = group.beams[0].request.num_output_tokens  # the tentative token included
        at_length = num_generated >= group.max_new_tokens
        stops = [at_length or c[2] in group.stop_ids for c in candidates]
        running = [c for c, stop in zip(candidates, stops, strict=True) if not stop][: group.width]
        self._finish_candidates(group, candidates[: group.width], stops[: group.width], num_generated)
        if running:
            best_length = num_generated
            if group.early_stopping == "never" and group.length_penalty > 0:
                best_length = group.max_new_tokens
            best_possible = running[0][0] / best_length**group.length_penalty
            worst_finished = min(h.score for h in group.finished) if group.is_full else _NEG_INF
            group.improvement_possible = group.improvement_possible and best_possible > worst_finished
        search_over = not running or not group.improvement_possible or (group.is_full and group.early_stopping is True)
        return [] if search_over else running

    def _finish_candidates(self, group, candidates, stops, num_generated) -> None:
        if (group.is_full and group.early_stopping is True) or not group.improvement_possible:
            return
        added = False
        for (score, index, token_id, logprob), stop in zip(candidates, stops, strict=True):
            if not stop:
                continue
            parent = group.beams[index]
            tokens = parent.request.output_token_ids[:-1] + [token_id]
            reason = "stop" if token_id in group.stop_ids else "length"
            penalised = score / num_generated**group.length_penalty
            group.finished.append(Hypothesis(tokens, parent.logprobs + [logprob], penalised, reason))
            added = True
        if added:
            group.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            del group.finished[group.width :]

    # ---- the beams' requests and blocks ------------------------------------------------------

    def _rebuild(self, group: BeamGroup, next_beams: list[tuple[float, int, int, float]]) -> list[str]:
        """Fork the next beams from their parents, then free the parents."""
        children = []
        for score, index, token_id, logprob in next_beams:
            parent = group.beams[index]
            child = self._fork(group, parent.request, token_id)
            children.append(Beam(child, score, parent.logprobs + [logprob]))
        released = [beam.request.request_id for beam in group.beams]
        for beam in group.beams:
            self._drop(beam.request)
        group.beams = children
        group.reported = {}
        for beam in children:
            self._beam_group[beam.request.request_id] = group
            self.scheduler.add_running(beam.request)
        return released

    def _fork(self, group: BeamGroup, parent: Request, token_id: int) -> Request:
        """A request equal to ``parent`` with its tentative last token replaced, sharing its blocks."""
        child = Request(
            request_id=f"{group.request_id}/beam{group.next_beam_id}",
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params,
            eos_token_ids=parent.eos_token_ids,
            max_model_len=parent.max_model_len,
            token_ids=parent.token_ids[:-1] + [token_id],
        )
        group.next_beam_id += 1
        child.output_token_ids = parent.output_token_ids[:-1] + [token_id]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.scheduled_time = parent.scheduled_time
        # Hashes of the blocks that end before the replaced token stay valid.
        num_unchanged_blocks = (child.num_tokens - 1) // self.kv.block_size
        child._block_hashes = parent._block_hashes[:num_unchanged_blocks]
        self.kv.fork(parent, child)
        return child

    def _drop(self, request: Request) -> None:
        self._beam_group.pop(request.request_id, None)
        if request.request_id in self.scheduler.requests:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def blocks_held(self, group: BeamGroup) -> int:
        """Distinct KV blocks the group's beams hold now (shared blocks count once)."""
        block_ids = set()
        for beam in group.beams:
            block_ids.update(self.kv.block_ids(beam.request.request_id))
        return len(block_ids)
