"""Structured output through a real cluster (router + prefill + decode workers) and the
official openai client: every constrained completion validates, on the aggregated and
the disaggregated paths, streamed and not, with n > 1."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from shared.tokenizer import Tokenizer
from tests.integration.cluster import scrape, start_router, start_worker, wait_worker

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6}, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
            },
            "score": {"type": "integer", "minimum": -5, "maximum": 40},
        },
        "required": ["user", "score"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "size": {"enum": ["S", "M", "L"]},
        },
        "required": ["colors", "size"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "note": {"type": "string", "maxLength": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["id"],
    },
}
MAX_TOKENS = 120
pytestmark = pytest.mark.slow  # four processes start for this module


@pytest.fixture(scope="module")
def routers(model_dir):
    """Two routers over the same workers: one disaggregated, one aggregated (no prefill pool)."""
    prefill = wait_worker(start_worker("prefill", model_dir, "--kv-transfer-backend", "tcp"))
    decode = wait_worker(start_worker("decode", model_dir, "--kv-transfer-backend", "tcp"))
    disagg, disagg_base = start_router(model_dir, [prefill], [decode])
    agg, agg_base = start_router(model_dir, [], [decode], "--tool-call-parser", "hermes")
    yield {"disaggregated": disagg_base, "aggregated": agg_base, "model": str(model_dir), "decode": decode.info["grpc"],
           "metrics": {"prefill": prefill.info["metrics_port"], "decode": decode.info["metrics_port"]}}  # fmt: skip
    for proc in (disagg, agg, prefill, decode):
        proc.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_json_schema_chat_every_choice_validates(routers, path):
    c = client(routers[path])
    for i, name in enumerate(SCHEMAS):
        resp = c.chat.completions.create(
            model=routers["model"],
            messages=[{"role": "user", "content": f"describe item {i}"}],
            response_format=response_format(name),  # type: ignore[arg-type]
            n=3, temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
        )  # fmt: skip
        assert len(resp.choices) == 3
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMAS[name])


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_json_schema_streamed_n2(routers, path):
    c = client(routers[path])
    for name in SCHEMAS:
        stream = c.chat.completions.create(
            model=routers["model"],
            messages=[{"role": "user", "content": "a record"}],
            response_format=response_format(name),  # type: ignore[arg-type]
            n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, stream=True,
        )  # fmt: skip
        texts, reasons = {0: "", 1: ""}, {}
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert reasons == {0: "stop", 1: "stop"}
        for text in texts.values():
            jsonschema.validate(json.loads(text), SCHEMAS[name])


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=8)


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_parse_with_pydantic_model(routers, path):
    c = client(routers[path])
    completion = c.chat.completions.parse(
        model=routers["model"],
        messages=[{"role": "user", "content": "a pet"}],
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        seed=3,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert 0 <= pet.age <= 30


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_regex_choice_and_json_object_on_completions(routers, path):
    c = client(routers[path])
    bodies = [
        ({"guided_regex": r"[a-z]{2,4}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{2,4}-[0-9]{3}", t)),
        ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"structured_outputs": {"choice": ["x y", "z"]}}, lambda t: t in ("x y", "z")),
        ({"guided_grammar": 'root ::= "a" ("b" | "c")'}, lambda t: t in ("ab", "ac")),
    ]
    for extra, check in bodies:
        resp = c.completions.create(
            model=routers["model"],
            prompt="the answer is",
            n=2,
            temperature=1.0,
            seed=1,
            max_tokens=40,
            extra_body=extra,
        )
        for choice in resp.choices:
            assert choice.finish_reason == "stop" and check(choice.text), (extra, choice.text)
    # completions.create has no response_format parameter: send the body as is.
    raw = c.post(
        "/completions", cast_to=object,
        body={"model": routers["model"], "prompt": "json:", "max_tokens": 8, "response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert raw["choices"][0]["text"].startswith("{")  # type: ignore[index]


@pytest.mark.parametrize(
    "extra, param, reason",
    [
        ({"guided_json": {"type": "nope"}}, "guided_json", "invalid JSON schema"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "[a-"}, None, "regex does not compile"),
        ({"guided_grammar": "root ::= ("}, None, "grammar does not compile"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ],
)
def test_bad_constraints_are_400(routers, extra, param, reason):
    c = client(routers["disaggregated"])
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=routers["model"], prompt="hi", max_tokens=4, stream=stream, extra_body=extra)
        assert reason in err.value.message
        if param is not None:
            assert err.value.body["param"] == param  # type: ignore[index]


def test_unconstrained_rows_unchanged_beside_constrained(routers):
    """Greedy outputs of plain requests are token-identical with and without constrained neighbours."""
    c = client(routers["aggregated"])
    model = routers["model"]
    prompts = ["the weather today", "once upon a time", "hello there friend"]

    def plain(prompt: str) -> str:
        body = {"ignore_eos": True}
        return (
            c.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0, extra_body=body)
            .choices[0]
            .text
        )

    alone = [plain(p) for p in prompts]

    def constrained(i: int) -> str:
        # Seeded: the same sampled neighbours in every run (their schema is checked below as well).
        body = {"guided_json": SCHEMAS["nested"]}
        return (
            c.completions.create(model=model, prompt=f"item {i}", max_tokens=MAX_TOKENS, seed=100 + i, extra_body=body)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(6) as pool:
        side = [pool.submit(constrained, i) for i in range(3)]
        mixed = [pool.submit(plain, p) for p in prompts]
        assert [f.result() for f in mixed] == alone
        for f in side:
            jsonschema.validate(json.loads(f.result()), SCHEMAS["nested"])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
TOOL_MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls(routers, path, tool_choice):
    c = client(routers[path])
    resp = c.chat.completions.create(
        model=routers["model"], messages=TOOL_MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice,  # type: ignore[arg-type, list-item]
        max_tokens=MAX_TOKENS, n=2, temperature=1.0, seed=5,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert [call.function.name for call in choice.message.tool_calls or []] == ["get_time"]
    stream = c.chat.completions.create(
        model=routers["model"], messages=TOOL_MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice,  # type: ignore[arg-type, list-item]
        max_tokens=MAX_TOKENS, temperature=1.0, seed=5, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for part in choice.delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
                if part.id:
                    assert entry["name"] is None and part.function and part.function.name  # name first
                    entry["id"], entry["name"] = part.id, part.function.name
                else:
                    assert entry["name"] is not None
                entry["arguments"] += (part.function.arguments if part.function else None) or ""
    assert reason == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMA_OF[entry["name"]])


def test_tool_history_and_auto(routers):
    """Assistant tool_calls and tool results in the history are accepted; auto answers with text or calls."""
    c = client(routers["aggregated"])
    history = [
        *TOOL_MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    resp = c.chat.completions.create(model=routers["model"], messages=history, tools=[WEATHER], max_tokens=8)  # type: ignore[arg-type, list-item]
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content is not None


def test_tool_errors(routers):
    c = client(routers["disaggregated"])  # started without --tool-call-parser
    bad = [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs a parser
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=routers["model"], messages=TOOL_MESSAGES, max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == param, err.value.message  # type: ignore[index]


def test_decode_worker_resumes_constraint_from_generated_tokens(routers, model_dir):
    """A request resumed on a decode worker (migration) replays its tokens into the grammar and continues."""
    tokenizer = Tokenizer.from_dir(model_dir)
    pattern = r"abc-[0-9]{3};"
    with grpc.insecure_channel(routers["decode"]) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)

        def generate(prefix: str) -> list[int]:
            sampling = pb.SamplingParams(n=1, temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=30, seed=4,
                                         constraint=pb.OutputConstraint(kind="regex", spec=pattern))  # fmt: skip
            request = pb.GenerateRequest(
                request_id=f"resume-{prefix}", prompt_token_ids=tokenizer.encode("code:"), sampling=sampling,
                generated_token_ids=tokenizer.encode(prefix, add_special_tokens=False),
            )  # fmt: skip
            responses = list(stub.Generate(request, timeout=60))
            assert responses[-1].finish_reason == "stop"
            return [t.token_id for r in responses for t in r.tokens]

        prefix_ids = tokenizer.encode("abc-1", add_special_tokens=False)
        text = tokenizer.decode(prefix_ids + generate("abc-1"))
        assert re.fullmatch(pattern, text), text
        with pytest.raises(grpc.RpcError) as err:
            generate("xyz")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "breaks the request's output constraint" in (err.value.details() or "")


def test_worker_metrics_count_constraints_and_compiles(routers):
    """Worker metrics: constrained requests, and compiles only for schemas not yet cached."""
    c = client(routers["aggregated"])
    schema = {"type": "object", "properties": {"metric_probe": {"type": "boolean"}}, "required": ["metric_probe"]}

    def counts() -> tuple[float, float]:
        port = routers["metrics"]["decode"]
        return scrape(port, "cleave_structured_output_requests_total"), scrape(port, "cleave_grammar_compiles_total")

    before = counts()
    for _ in range(2):
        c.completions.create(model=routers["model"], prompt="x", max_tokens=20, extra_body={"guided_json": schema})
    after = counts()  # counters are updated as requests arrive, not on the 1 s poll
    assert after[0] - before[0] == 2 and after[1] - before[1] == 1
