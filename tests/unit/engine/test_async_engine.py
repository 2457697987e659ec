"""The service-side engine loop: batching from many callers, cancellation, aborts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared.config import EngineConfig
from shared.engine import LLM, SamplingParams
from shared.engine.async_engine import IDLE_CHECK_AFTER_S, AsyncEngine, EngineDeadError, NewRequest
from shared.engine.sampling_params import InvalidRequestError


def make_engine(model_dir) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64, block_size=4))


def test_concurrent_streams_match_offline_and_free_blocks(checkpoint_factory):
    model_dir = checkpoint_factory("llama")
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = LLM(model=str(model_dir), dtype="float32", num_blocks=64, block_size=4)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    engine = make_engine(model_dir)

    async def one(i):
        tokens = []
        async for delta in engine.generate(f"r{i}", prompts[i], params):
            tokens += delta.new_token_ids
        return tokens

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        assert asyncio.run(run()) == expected
        assert engine.core.stats().num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()


def test_an_announced_stream_yields_one_delta_without_tokens_once_admitted(checkpoint_factory):
    model_dir = checkpoint_factory("llama")
    prompt, params = list(range(5, 16)), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = LLM(model=str(model_dir), dtype="float32", num_blocks=64, block_size=4).generate([prompt], params)
    engine = make_engine(model_dir)
    gate = threading.Event()

    def hold_the_next_step(_request) -> None:  # on the engine thread, in the admitting command
        engine.call(gate.wait)  # runs right after that command: no step before the gate opens

    async def run():
        deltas = []
        async for delta in engine.stream(NewRequest("a", prompt, params, hold_the_next_step), announce=True):
            if not deltas:  # the announcement: the request is queued, and no step has computed it
                assert engine.core.scheduler.requests["a"].num_computed_tokens == 0
                gate.set()
            deltas.append(delta)
        return deltas

    try:
        deltas = asyncio.run(run())
        assert deltas[0].new_token_ids == [] and not deltas[0].finished
        assert all(d.new_token_ids for d in deltas[1:])
        assert [t for d in deltas for t in d.new_token_ids] == expected[0].outputs[0].token_ids
    finally:
        engine.shutdown()


def test_the_idle_ownership_check_waits_for_a_quiet_moment_after_a_command(checkpoint_factory):
    engine = make_engine(checkpoint_factory("llama"))
    checks: list[float] = []
    check = engine.core.ownership_problems

    def timed_check() -> list[str]:
        checks.append(time.monotonic())
        return check()

    engine.core.ownership_problems = timed_check
    try:
        # A command on an idle engine: the check (milliseconds on a large cache, the GIL held) must not
        # run between the command and its caller's next step; it comes once nothing else has arrived.
        ran_at = engine.call(time.monotonic).result(timeout=10)
        deadline = time.monotonic() + 10
        while not [t for t in checks if t > ran_at] and time.monotonic() < deadline:
            time.sleep(0.01)
        after = [t for t in checks if t > ran_at]
        assert after and after[0] - ran_at >= 0.9 * IDLE_CHECK_AFTER_S
    finally:
        engine.shutdown()


def test_cancelled_command_does_not_stop_the_loop(checkpoint_factory):
    engine = make_engine(checkpoint_factory("llama"))
    try:
        gate = threading.Event()
        blocker = engine.call(gate.wait)  # holds the engine thread while the next command is cancelled
        cancelled = engine.call(lambda: None)
        assert cancelled.cancel()
        gate.set()
        blocker.result(timeout=10)
        assert engine.call(lambda: 41 + 1).result(timeout=10) == 42
        assert engine.error is None
    finally:
        engine.shutdown()


def test_leaving_a_stream_early_aborts_and_frees(checkpoint_factory):
    engine = make_engine(checkpoint_factory("llama"))

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        stream = engine.generate("early", list(range(3, 30)), params)
        async for _ in stream:
            break
        await stream.aclose()

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 5
        while engine.core.stats().num_free_blocks != engine.core.num_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.core.stats().num_free_blocks == engine.core.num_blocks
        assert not engine.core.has_unfinished()
    finally:
        engine.shutdown()


def test_fire_and_forget_command_failures_are_logged(checkpoint_factory, caplog):
    import logging

    engine = make_engine(checkpoint_factory("llama"))
    try:
        with caplog.at_level(logging.ERROR, logger="cleave.engine"):
            engine.submit(lambda: 1 // 0, "broken_command")
            ran = threading.Event()
            engine.submit(ran.set, "later_command")  # commands run in order: the failure came first
            assert ran.wait(30)
            deadline = time.monotonic() + 30
            while not any("command=broken_command" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the failing command was not logged"
                time.sleep(0.01)
        assert engine.error is None  # a command's error does not stop the loop
    finally:
        engine.shutdown()


def test_stop_sample_ends_one_sample_of_a_fork_and_frees_its_blocks(checkpoint_factory):
    model_dir = checkpoint_factory("llama")
    engine = make_engine(model_dir)
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)

    async def run():
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        reasons: dict[int, str | None] = {}
        async for delta in engine.generate("fork", list(range(5, 25)), params):
            tokens[delta.sample_index] += delta.new_token_ids
            if delta.finished:
                reasons[delta.sample_index] = delta.finish_reason
            if delta.sample_index == 1 and len(tokens[1]) == 2 and not delta.finished:
                assert await engine.run(lambda: engine.stop_sample("fork/1"))
                assert not await engine.run(lambda: engine.stop_sample("fork/1"))  # already gone
        return tokens, reasons

    try:
        tokens, reasons = asyncio.run(run())
        assert reasons == {0: "length", 1: "stop", 2: "length"}
        assert len(tokens[1]) < 30 and len(tokens[0]) == len(tokens[2]) == 30
        assert engine.core.stats().num_free_blocks == engine.core.num_blocks
        assert not asyncio.run(engine.run(lambda: engine.stop_sample("nothing")))
    finally:
        engine.shutdown()


def test_a_steps_tokens_are_published_when_the_next_forward_starts(checkpoint_factory):
    """Step N's deltas reach their streams just before step N+1's model compute (the event loop then
    streams them while the forward runs), before any command runs, and when the engine goes idle."""
    engine = make_engine(checkpoint_factory("llama"))
    published: list[list[str]] = []  # request ids per publication, in order
    events: list[str] = []
    real_publish, real_step = engine._publish_all, engine.core.step

    def publish(deltas):
        published.append([f"{d.request_id}:{len(d.new_token_ids)}" for d in deltas])
        events.append("publish")
        real_publish(deltas)

    def step(before_forward=None, after_execute=None):
        def before():
            events.append("before_forward")
            if before_forward is not None:
                before_forward()

        deltas = real_step(before, after_execute)
        events.append(f"step:{len(deltas)}")
        return deltas

    engine._publish_all = publish
    engine.core.step = step
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run():
        tokens = []
        async for delta in engine.generate("r0", list(range(5, 12)), params):
            tokens += delta.new_token_ids
        return tokens

    try:
        assert len(asyncio.run(run())) == 4
        steps = [i for i, e in enumerate(events) if e.startswith("step:")]
        assert len(steps) == 4
        for prev, nxt in zip(steps, steps[1:], strict=False):
            # between a step and the next one's compute: exactly one publication, after before_forward
            window = events[prev + 1 : nxt]
            assert window == ["before_forward", "publish"], window
        assert events[steps[-1] + 1 :] == ["publish"]  # the last step's tokens: when the engine goes idle
        assert engine.call(lambda: 1).result(timeout=10) == 1
    finally:
        engine.shutdown()


def test_commands_queued_when_the_loop_dies_fail_instead_of_hanging(checkpoint_factory):
    engine = make_engine(checkpoint_factory("llama"))
    in_step, release = threading.Event(), threading.Event()

    def failing_step(before_forward=None, after_execute=None):
        in_step.set()
        release.wait(10)
        raise RuntimeError("boom")

    engine.core.step = failing_step
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        request = engine.call(lambda: engine.core.make_request("r0", [5, 6, 7], params)).result(timeout=10)
        engine.call(lambda: engine.core.scheduler.add_request(request)).result(timeout=10)
        assert in_step.wait(10)
        queued = engine.call(lambda: 42)  # waits behind the step that is about to fail
        release.set()
        with pytest.raises(EngineDeadError, match="boom"):
            queued.result(timeout=10)
        with pytest.raises(EngineDeadError):
            engine.call(lambda: 1)
    finally:
        engine.shutdown()


def test_a_new_request_is_made_and_queued_in_one_command_and_a_duplicate_id_leaves_the_first_alone(
    checkpoint_factory,
):
    engine = make_engine(checkpoint_factory("llama"))
    commands = []
    real_call = engine.call

    def counting_call(fn):
        commands.append(fn)
        return real_call(fn)

    engine.call = counting_call
    # Long enough that the first request is still running when its first delta is read: the engine
    # runs ahead of a slow reader, and an id is free again once its request finished.
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def first():
        tokens = []
        checked = False
        async for delta in engine.generate("dup", [5, 6, 7, 8], params):
            tokens += delta.new_token_ids
            if not checked:
                checked = True
                with pytest.raises(InvalidRequestError, match="already in use"):
                    async for _ in engine.generate("dup", [9, 10], params):
                        pass
        return tokens

    try:
        n_before = len(commands)
        assert len(asyncio.run(first())) == 200  # the duplicate neither stole nor aborted its stream
        # one command to admit each request (the first and the refused duplicate), nothing else
        assert len(commands) - n_before == 2
        assert engine.core.stats().num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()


def test_run_soon_runs_during_the_forward_of_the_step_in_flight(checkpoint_factory):
    """A command that needs no step boundary (a KV pull's allocation) runs while a forward computes,
    not after the step; between steps it waits for the boundary like any command."""
    engine = make_engine(checkpoint_factory("llama"))
    in_forward, release = threading.Event(), threading.Event()
    real_step = engine.core.step
    step_done = []

    def step(before_forward=None, after_execute=None):
        def before():
            before_forward()
            in_forward.set()
            release.wait(10)  # the forward "computes" until the test has run its command

        deltas = real_step(before, after_execute)
        step_done.append(True)
        return deltas

    engine.core.step = step
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def run():
        stream = engine.generate("busy", [5, 6, 7, 8], params)
        consume = asyncio.ensure_future(stream.__anext__())
        while not in_forward.is_set():
            await asyncio.sleep(0.005)
        made = await engine.run_soon(lambda: engine.core.make_request("pulled", [9, 10, 11], params))
        assert not step_done  # it ran inside the step in flight
        release.set()
        await consume
        await stream.aclose()
        return made

    try:
        made = asyncio.run(run())
        assert made.request_id == "pulled" and step_done
        gate = threading.Event()
        blocker = engine.call(gate.wait)  # the engine thread between steps, holding the state

        async def between_steps():
            soon = asyncio.ensure_future(engine.run_soon(lambda: 7))
            await asyncio.sleep(0.05)
            assert not soon.done()  # waits for the boundary
            gate.set()
            return await soon

        assert asyncio.run(between_steps()) == 7
        blocker.result(timeout=10)
    finally:
        release.set()
        engine.shutdown()


def test_run_soon_queued_before_a_forward_runs_when_it_starts_and_never_overtakes(checkpoint_factory):
    """Submitted while the engine thread schedules a step, a run_soon command runs when that step's forward
    starts, not after the step; one queued behind another command waits with it for the boundary."""
    engine = make_engine(checkpoint_factory("llama"))
    events: list[str] = []
    scheduling, go = threading.Event(), threading.Event()
    # hold: the next schedule() waits for the test; hold_next: so does the one after the step in flight,
    # so the request cannot run to its end between two checks however fast this machine steps.
    hold, hold_next = [True], [False]
    real_schedule, real_step = engine.core.scheduler.schedule, engine.core.step

    def schedule():
        if hold[0]:  # the engine thread holds the state here, before the forward
            hold[0] = False
            scheduling.set()
            go.wait(10)
            go.clear()
        return real_schedule()

    def step(before_forward=None, after_execute=None):
        def before():
            before_forward()
            events.append("forward")  # the forward computes from here

        deltas = real_step(before, after_execute)
        events.append("step end")
        if hold_next[0]:
            hold_next[0], hold[0] = False, True
        return deltas

    engine.core.scheduler.schedule = schedule
    engine.core.step = step
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def during_schedule(*commands, then_hold=False):
        deadline = time.monotonic() + 10
        while not scheduling.is_set():
            assert time.monotonic() < deadline, "the engine thread never scheduled a step"
            await asyncio.sleep(0.002)
        scheduling.clear()
        events.clear()
        hold_next[0] = then_hold
        futures = [asyncio.ensure_future(c()) for c in commands]
        await asyncio.sleep(0.05)
        assert not any(f.done() for f in futures)  # the state is the engine thread's
        go.set()
        await asyncio.gather(*futures)
        deadline = time.monotonic() + 10
        while "step end" not in events and time.monotonic() < deadline:  # the engine thread goes on meanwhile
            await asyncio.sleep(0.002)
        return list(events)

    async def run():
        stream = engine.generate("busy", [5, 6, 7, 8], params)
        consume = asyncio.ensure_future(stream.__anext__())
        soon_first = await during_schedule(lambda: engine.run_soon(lambda: events.append("soon")), then_hold=True)
        behind = await during_schedule(
            lambda: engine.run(lambda: events.append("command")), lambda: engine.run_soon(lambda: events.append("soon"))
        )
        await consume
        await stream.aclose()
        return soon_first, behind

    try:
        soon_first, behind = asyncio.run(run())
        assert soon_first[:2] == ["soon", "forward"]  # before the step in flight computed, let alone ended
        assert behind[:4] == ["forward", "step end", "command", "soon"]
    finally:
        go.set()
        engine.shutdown()


def test_a_yielding_decode_engine_pauses_after_each_step_while_the_prefill_side_has_a_queue(
    checkpoint_factory, tmp_path
):
    """cleave serve's decode worker under a prefill backlog (CoreShare.yield_after): after each step its
    engine idles, its slot marked idle so the prefill worker's kernels borrow its CPUs, and the tokens are
    those of the offline engine; once the queue is gone it steps without pausing."""
    from shared.engine.cpu_threads import CoreShare

    model_dir = checkpoint_factory("llama")
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(model_dir), dtype="float32", num_blocks=64,
                                                      block_size=4).generate(prompts, params)]  # fmt: skip
    share_file = tmp_path / "share"
    share_file.write_bytes(bytes(16))
    prefill = CoreShare(f"{share_file}:lend:0")
    engine = make_engine(model_dir)
    share = engine.core.core_share = CoreShare(f"{share_file}:lend:1:borrow:0:0", yield_ratio=2.0)
    pauses: list[tuple[float, float]] = []  # (pause, the decode slot's value during it)
    yield_after, idle = share.yield_after, share.idle
    lent: list[float] = []

    running: list[int] = []  # what the engine said it runs, step by step

    def recorded_yield_after(step_s: float, num_running: int = 0) -> float:
        running.append(num_running)
        pause = yield_after(step_s, num_running)
        pauses.append((pause, step_s))
        return pause

    def recorded_idle() -> None:
        idle()
        lent.append(share._idle_since(1))

    share.yield_after, share.idle = recorded_yield_after, recorded_idle  # type: ignore[method-assign]

    async def run(offset: int) -> list[list[int]]:
        async def one(i):
            return [t async for d in engine.generate(f"r{offset + i}", prompts[i], params) for t in d.new_token_ids]

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        prefill.before_step(num_requests=5)  # the prefill worker computes, four more prompts queued
        assert asyncio.run(run(0)) == expected
        engine.call(lambda: None).result(timeout=30)  # the last pause has begun (its streams end just before)
        assert len(pauses) >= 6 and all(p == pytest.approx(2.0 * s) and p > 0.0 for p, s in pauses)
        assert max(running) == len(prompts) and min(running) == 0  # fewer than the prefill side's five
        assert len(lent) >= len(pauses) and all(t > 0.0 for t in lent)  # idle (its CPUs lent) in each pause
        pauses.clear()
        prefill.before_step(num_requests=1)  # the queue is gone
        assert asyncio.run(run(10)) == expected
        assert pauses and all(p == 0.0 for p, _ in pauses)
        assert engine.core.stats().num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()
