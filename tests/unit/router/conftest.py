"""Fixtures for the router's HTTP tests: a tokenizer directory, scripted workers, a live router.

The workers here are test doubles: real gRPC servers on port 0 implementing the
``PrefillWorker`` and ``DecodeWorker`` services, but with a deterministic token
script instead of a model, so every expected text is known in advance. The
real end-to-end tests run the real workers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn

from services.router.app import create_app
from services.router.settings import RouterSettings
from shared.genproto.cleave.v1 import worker_pb2, worker_pb2_grpc
from shared.models.demo import demo_vocab_size, write_generation_config, write_tokenizer_files
from shared.tokenizer import Tokenizer

MODEL_NAME = "tiny-test"
MAX_MODEL_LEN = 256
EOS_ID = 1  # <|end_of_text|> of the demo tokenizer
SCRIPT_TEXT = " The router streams tokens to the client. Then it stops at END of the text. Caf\u00e9 \u4e16\u754c!"


@dataclass
class WorkerScript:
    """What the scripted workers generate and how they behave; tests edit it, each test starts fresh.

    Output position ``i`` of a request is ``token_ids[(seed + i) % len]`` (seed 0 when unset), or EOS
    at ``eos_at``. Logprob of position ``i`` is ``-(i + 1) / 10``; its k-th alternative is token
    ``id + k + 1`` with logprob ``-(i + 1) / 10 - (k + 1)``.
    """

    token_ids: list[int]
    eos_at: int | None = None
    tokens_per_message: int = 1
    delay_s: float = 0.0
    fail_prefill: grpc.StatusCode | None = None
    fail_generate: grpc.StatusCode | None = None
    break_after: int | None = None  # the next Generate stream breaks (UNAVAILABLE) after this many messages
    decode_gate: threading.Event | None = None  # when set: Generate sends nothing until the event is
    # Recorded calls
    prefill_requests: list = field(default_factory=list)
    generate_requests: list = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    aborted_samples: list[str] = field(default_factory=list)  # Abort(sample_only): one sample of a fork
    released: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    num_streaming: int = 0  # Generate calls open now: the scripted decode worker reports them as queued

    def token_at(self, seed: int, i: int) -> int:
        if self.eos_at is not None and i == self.eos_at:
            return EOS_ID
        return self.token_ids[(seed + i) % len(self.token_ids)]

    def output(self, sampling: worker_pb2.SamplingParams, i: int) -> tuple[worker_pb2.TokenOutput, str]:
        """Token at position ``i`` and the finish reason it causes ("" to go on)."""
        token_id = self.token_at(sampling.seed if sampling.HasField("seed") else 0, i)
        logprob = -(i + 1) / 10
        top = []
        if sampling.HasField("logprobs"):
            top = [
                worker_pb2.TokenLogprob(token_id=token_id + k + 1, logprob=logprob - k - 1)
                for k in range(sampling.logprobs)
            ]
        token = worker_pb2.TokenOutput(token_id=token_id, logprob=logprob, top_logprobs=top)
        if token_id in sampling.stop_token_ids or (token_id == EOS_ID and not sampling.ignore_eos):
            return token, "stop"
        if sampling.HasField("max_tokens") and i + 1 >= sampling.max_tokens:
            return token, "length"
        return token, ""

    @staticmethod
    def prompt_logprobs(request) -> list[worker_pb2.TokenOutput]:
        """Scores of prompt tokens 1.. when asked: token ``t`` at position ``p`` gets ``-p / 100``, rank ``p``."""
        if not request.sampling.HasField("prompt_logprobs"):
            return []
        k = request.sampling.prompt_logprobs
        return [
            worker_pb2.TokenOutput(
                token_id=t,
                logprob=-p / 100,
                rank=p,
                top_logprobs=[worker_pb2.TokenLogprob(token_id=t + j + 1, logprob=-j - 1) for j in range(k)],
            )  # fmt: skip
            for p, t in enumerate(request.prompt_token_ids)
            if p > 0
        ]

    def ids(self, num_tokens: int, seed: int = 0) -> list[int]:
        return [self.token_at(seed, i) for i in range(num_tokens)]


class _Health:
    role = ""

    def Health(self, request, context):
        return worker_pb2.HealthResponse(status="ok", role=self.role, model=MODEL_NAME, worker_id=f"fake-{self.role}")

    def LoadStats(self, request, context):
        queued = self.script.num_streaming if self.role == "decode" else 0
        return worker_pb2.LoadStatsResponse(num_free_blocks=100, num_total_blocks=100, num_waiting=queued)

    def Abort(self, request, context):
        if request.sample_only:
            self.script.aborted_samples.append(request.request_id)
        else:
            self.script.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(found=True)


class FakePrefillWorker(_Health, worker_pb2_grpc.PrefillWorkerServicer):
    """Test double of a prefill worker: returns the script's first token and a made-up KV handle."""

    role = "prefill"

    def __init__(self, script_ref: Callable[[], WorkerScript]) -> None:
        self._script = script_ref

    @property
    def script(self) -> WorkerScript:
        return self._script()

    def Prefill(self, request, context):
        self.script.prefill_requests.append(request)
        self.script.metadata.append(dict(context.invocation_metadata()))
        if self.script.fail_prefill is not None:
            context.abort(self.script.fail_prefill, "injected prefill failure")
        token, finish = self.script.output(request.sampling, 0)
        response = worker_pb2.PrefillResponse(
            first_token=token, num_prompt_tokens=len(request.prompt_token_ids), finish_reason=finish,
            prompt_logprobs=self.script.prompt_logprobs(request),
        )  # fmt: skip
        if not finish:
            response.kv_handle.CopyFrom(
                worker_pb2.KVHandle(
                    protocol_version=1,
                    request_id=request.request_id,
                    worker_id="fake-prefill",
                    block_ids=[0, 1],
                    num_tokens=len(request.prompt_token_ids),
                )
            )
        return response

    def ReleaseKV(self, request, context):
        self.script.released.append(request.request_id)
        return worker_pb2.ReleaseKVResponse(released=True)


class FakeDecodeWorker(_Health, worker_pb2_grpc.DecodeWorkerServicer):
    """Test double of a decode worker: streams the script, continuing after ``first_token`` if given."""

    role = "decode"

    def __init__(self, script_ref: Callable[[], WorkerScript]) -> None:
        self._script = script_ref

    @property
    def script(self) -> WorkerScript:
        return self._script()

    def Generate(self, request, context):
        script = self.script
        script.generate_requests.append(request)
        script.metadata.append(dict(context.invocation_metadata()))
        if script.fail_generate is not None:
            context.abort(script.fail_generate, "injected generate failure")
        scores = script.prompt_logprobs(request)
        # The RPC ends either after the last message or by the client's cancellation.
        done = []
        context.add_callback(lambda: None if done else script.cancelled.append(request.request_id))
        _count_stream(script, 1)
        context.add_callback(lambda: _count_stream(script, -1))
        num_sent = 0
        if script.decode_gate is not None:
            script.decode_gate.wait(timeout=30)
        if request.announce_admission:  # as a real decode worker: once the request is queued, no tokens
            yield worker_pb2.GenerateResponse()
        # n > 1 (a fork): sample i follows the script with seed + i (when seeded), one sample after the other.
        for sample in range(max(1, request.sampling.n)):
            sampling = worker_pb2.SamplingParams()
            sampling.CopyFrom(request.sampling)
            if sample and sampling.HasField("seed"):
                sampling.seed = (sampling.seed + sample + 2**63) % 2**64 - 2**63  # wraps within int64
            # After a prefill the first token is the client's already, except in a fork: the decode
            # worker draws every sample's first token itself.
            position = 1 if request.HasField("first_token") and request.sampling.n <= 1 else 0
            position += len(request.generated_token_ids)  # a migrated request goes on after them
            batch, finish = [], ""
            while not finish and context.is_active():
                token, finish = script.output(sampling, position)
                batch.append(token)
                position += 1
                if len(batch) == script.tokens_per_message or finish:
                    yield worker_pb2.GenerateResponse(
                        tokens=batch, finish_reason=finish, num_prompt_tokens=len(request.prompt_token_ids),
                        prompt_logprobs=scores, sample_index=sample,
                    )  # fmt: skip
                    batch, scores = [], []
                    num_sent += 1
                    if script.break_after is not None and num_sent >= script.break_after:
                        script.break_after = None  # once: the worker the stream moves to serves it
                        context.abort(grpc.StatusCode.UNAVAILABLE, "injected stream break")
                    if script.delay_s:
                        time.sleep(script.delay_s)
        done.append(True)


_COUNT_LOCK = threading.Lock()


def _count_stream(script: WorkerScript, change: int) -> None:
    with _COUNT_LOCK:
        script.num_streaming += change


class _ScriptHolder:
    def __init__(self, script: WorkerScript) -> None:
        self.script = script


def _serve(servicer, add_fn, port: int = 0) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_fn(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"


class LiveRouter:
    """The router app served by uvicorn on port 0 in a background thread."""

    def __init__(self, app) -> None:
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def state(self):
        return self.app.state.router

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Tokenizer files of the demo model plus a config.json; no weights (the router needs none)."""
    path = tmp_path_factory.mktemp("router-model")
    special_ids = write_tokenizer_files(path)
    write_generation_config(path, special_ids)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": demo_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_MODEL_LEN,
        "bos_token_id": special_ids["<|begin_of_text|>"],
        "eos_token_id": special_ids["<|end_of_text|>"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def _holder(tokenizer) -> _ScriptHolder:
    return _ScriptHolder(WorkerScript(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)))


@pytest.fixture
def script(_holder, tokenizer) -> WorkerScript:
    """A fresh script for this test (the servers are shared by the session)."""
    _holder.script = WorkerScript(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))
    return _holder.script


@pytest.fixture(scope="session")
def worker_addrs(_holder) -> Iterator[dict[str, str]]:
    prefill, prefill_addr = _serve(
        FakePrefillWorker(lambda: _holder.script), worker_pb2_grpc.add_PrefillWorkerServicer_to_server
    )
    decode, decode_addr = _serve(
        FakeDecodeWorker(lambda: _holder.script), worker_pb2_grpc.add_DecodeWorkerServicer_to_server
    )
    yield {"prefill": prefill_addr, "decode": decode_addr}
    prefill.stop(None)
    decode.stop(None)


@pytest.fixture
def start_decode_worker(_holder) -> Iterator[Callable[[int], str]]:
    """``start_decode_worker(port)``: one more scripted decode worker, stopped after the test."""
    servers = []

    def start(port: int) -> str:
        server, addr = _serve(
            FakeDecodeWorker(lambda: _holder.script), worker_pb2_grpc.add_DecodeWorkerServicer_to_server, port
        )
        servers.append(server)
        return addr

    yield start
    for server in servers:
        server.stop(None)


@pytest.fixture(scope="session")
def router_factory(model_dir, worker_addrs) -> Iterator[Callable[..., LiveRouter]]:
    """``router_factory(prefill=True, decode=True, **settings)``: a live router, one per configuration."""
    routers: dict[str, LiveRouter] = {}

    def factory(prefill: bool | list[str] = True, decode: bool | list[str] = True, **overrides) -> LiveRouter:
        key = repr((prefill, decode, sorted(overrides.items())))
        if key not in routers:

            def addrs(value: bool | list[str], role: str) -> tuple[str, ...]:
                return tuple(value) if isinstance(value, list) else ((worker_addrs[role],) if value else ())

            settings = RouterSettings(
                model=str(model_dir),
                served_model_name=MODEL_NAME,
                prefill_workers=addrs(prefill, "prefill"),
                decode_workers=addrs(decode, "decode"),
                health_interval_s=0.5,
                **overrides,
            )
            routers[key] = LiveRouter(create_app(settings))
        return routers[key]

    yield factory
    for router in routers.values():
        router.stop()


@pytest.fixture
def router(router_factory, script) -> LiveRouter:
    """Disaggregated: one scripted prefill worker and one scripted decode worker."""
    return router_factory()


@pytest.fixture
def agg_router(router_factory, script) -> LiveRouter:
    """Aggregated: a scripted decode worker only."""
    return router_factory(prefill=False)


def read_sse(response) -> list:
    """Payloads of an SSE response: parsed JSON objects, and the final ``"[DONE]"`` string."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture
def stream_post() -> Callable[[LiveRouter, str, dict], list]:
    """``stream_post(router, path, body)``: POST with ``stream: true``; returns the SSE payloads."""

    def post(router: LiveRouter, path: str, body: dict) -> list:
        with httpx.Client(base_url=router.url, timeout=30) as client:
            with client.stream("POST", path, json={**body, "stream": True}) as response:
                assert response.status_code == 200, response.read()
                assert response.headers["content-type"].startswith("text/event-stream")
                return read_sse(response)

    return post


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def eventually() -> Callable[..., bool]:
    """``eventually(predicate, timeout_s=5)``: poll until true (worker calls land asynchronously)."""
    return wait_for
