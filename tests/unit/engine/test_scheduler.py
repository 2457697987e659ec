from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus, TokenSample
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=16, block_size=4, budget=16, max_seqs=8):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv), kv


def req(rid, n_prompt, max_tokens=4, start=0):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request_id: [TokenSample(token)] * len(s.sample_request_ids) for s in out.seqs if s.sample_request_ids}
    sched.update_from_output(out, sampled)
    return out


def test_chunked_prefill_then_decode_under_budget():
    sched, kv = make(budget=6)
    sched.add_request(req("a", 10))
    out = run_step(sched)
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample_request_ids) for s in out.seqs] == [("a", 6, 0, [])]
    out = run_step(sched)
    assert [(len(s.token_ids), s.start_pos, s.sample_request_ids) for s in out.seqs] == [(4, 6, ["a"])]
    out = run_step(sched)
    assert [(len(s.token_ids), s.start_pos) for s in out.seqs] == [(1, 10)]


def test_running_decodes_come_before_new_prefills():
    sched, kv = make(budget=8)
    sched.add_request(req("a", 4))
    run_step(sched)
    sched.add_request(req("b", 12))
    out = run_step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 1), ("b", 7)]
    assert out.num_batched_tokens == 8


def test_max_num_seqs_caps_running():
    sched, kv = make(max_seqs=2)
    for i in range(3):
        sched.add_request(req(str(i), 2, start=10 * i))
    out = run_step(sched)
    assert [s.request_id for s in out.seqs] == ["0", "1"]
    assert len(sched.waiting) == 1


def test_preempts_newest_by_recompute_and_frees_everything():
    sched, kv = make(num_blocks=4, block_size=4, budget=32)
    sched.add_request(req("old", 7, max_tokens=8))
    sched.add_request(req("new", 7, max_tokens=8, start=100))
    run_step(sched)  # both prefilled: 2 blocks each, all 4 used
    assert kv.num_free_blocks == 0
    out = run_step(sched)  # position 7 still fits in each request's second block
    assert out.preempted_ids == [] and len(out.seqs) == 2
    # Position 8 needs a third block for "old": "new" (the newest) is preempted.
    out = run_step(sched)
    assert out.preempted_ids == ["new"]
    assert [s.request_id for s in out.seqs] == ["old"]
    new = sched.waiting[0]
    assert new.request_id == "new" and new.num_computed_tokens == 0 and new.status == RequestStatus.PREEMPTED
    while sched.num_unfinished:
        run_step(sched)
    assert kv.num_free_blocks == 4
    assert sched.num_preemptions >= 1


def test_finish_on_max_tokens_and_abort_free_blocks():
    sched, kv = make()
    a = req("a", 5, max_tokens=2)
    sched.add_request(a)
    sched.add_request(req("b", 5, max_tokens=50, start=50))
    run_step(sched)
    run_step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 7]
    assert sched.abort("b") is not None
    assert sched.abort("b") is None
    assert kv.num_free_blocks == 16


def test_prefix_cache_hit_counts_only_uncached_tokens():
    sched, kv = make(budget=64)
    sched.add_request(req("a", 13, max_tokens=1))
    run_step(sched)
    sched.add_request(req("b", 13, max_tokens=1))
    out = sched.schedule()
    # 3 full blocks are cached, but 12 of 13 tokens hit at most: the last block needs the final token.
    assert [(s.start_pos, len(s.token_ids)) for s in out.seqs] == [(12, 1)]
    assert sched.requests["b"].num_cached_tokens == 12


def test_fork_n2_shares_prompt_blocks():
    sched, kv = make(budget=64)
    parent = req("p", 6, max_tokens=3)
    parent.pending_children = [Request("p/1", parent.prompt_token_ids, parent.sampling_params, seed_offset=1)]
    sched.add_request(parent)
    out = run_step(sched)
    assert out.seqs[0].sample_request_ids == ["p", "p/1"]
    assert kv.block_ids("p/1") == kv.block_ids("p") == [0, 1]
    out = run_step(sched)
    assert out.block_copies == [(1, 2)]  # the child copies the shared partial block before writing
    while sched.num_unfinished:
        run_step(sched)
    assert kv.num_free_blocks == 16


def _started(sched, token=7):
    """Ids of the requests that started (their first chunk) in one step."""
    before = {r.request_id for r in sched.running}
    run_step(sched, token)
    return [r.request_id for r in sched.running if r.request_id not in before]


def test_shortest_first_starts_the_shortest_waiting_prompt_and_fcfs_the_first_to_arrive():
    results = {}
    for policy in ("shortest-first", "fcfs"):
        kv = KVCacheManager(64, 4)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=8, scheduling_policy=policy), kv)
        for rid, n in (("long", 12), ("mid", 8), ("short", 3), ("short2", 3)):
            sched.add_request(req(rid, n, start=100 * len(sched.waiting)))
        results[policy] = [_started(sched) for _ in range(4)]
    # Budget 12: the two 3-token prompts (equals in arrival order) and 6 of the 8, then (after the running
    # requests' tokens) the 12-token one; arrival order starts the 12 alone, then the 8 and a 3, then the other.
    assert results["shortest-first"][:2] == [["short", "short2", "mid"], ["long"]]
    assert results["fcfs"][:3] == [["long"], ["mid", "short"], ["short2"]]


def test_shortest_first_lets_a_request_waiting_too_long_go_first_and_a_preempted_one_before_all():
    from shared.config import OVERTAKE_MAX_WAIT_S

    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, scheduling_policy="shortest-first"), kv)
    for rid, n in (("old-long", 20), ("short", 3)):
        sched.add_request(req(rid, n, start=100 * len(sched.waiting)))
    now = sched.waiting[-1].arrival_time

    def order(now, limit=8):
        return [r.request_id for r in sched.start_order(now, limit)]

    assert order(now) == ["short", "old-long"] and order(now, 1) == ["short"]  # the short one overtakes
    # not once the long one has waited this long
    assert order(now + OVERTAKE_MAX_WAIT_S) == ["old-long", "short"]
    sched.waiting[0].status = RequestStatus.PREEMPTED  # preemption puts a request at the front: it goes first
    assert order(now) == ["old-long", "short"]
    sched.waiting[0].status = RequestStatus.WAITING
    run_step(sched)  # started in that order, and out of the queue
    assert [r.request_id for r in sched.running] == ["short", "old-long"] and not sched.waiting


def test_an_unknown_scheduling_policy_is_refused():
    import pytest

    from shared.config import EngineConfig

    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="m", scheduling_policy="lifo")
