"""``cleave bench serve``'s streaming client against a real HTTP server on loopback that splits its
server-sent events at awkward places: inside a line, several events in one write, CRLF line ends."""

from __future__ import annotations

import asyncio
import json

import pytest

from shared.bench.serve import one_request
from shared.bench.workload import BenchRequest


def _events(texts: list[str], completion_tokens: int, crlf: bool) -> bytes:
    end = "\r\n" if crlf else "\n"
    lines = [json.dumps({"choices": [{"index": 0, "text": t}]}) for t in texts]
    lines.append(json.dumps({"choices": [], "usage": {"completion_tokens": completion_tokens}}))
    return "".join(f"data: {line}{end}{end}" for line in lines).encode() + f"data: [DONE]{end}{end}".encode()


async def _serve(status: int, payload: bytes, cuts: list[int], seen: list[dict]):
    """An HTTP/1.1 server answering one POST with ``payload`` in chunked encoding, cut at ``cuts``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        seen.append(json.loads(await reader.readexactly(length)))
        kind = b"text/event-stream" if status == 200 else b"application/json"
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % (status, kind))
        for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True):
            writer.write(b"%x\r\n%s\r\n" % (b - a, payload[a:b]))
            await writer.drain()
            await asyncio.sleep(0.01)  # separate reads on the client's side
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _request(status: int, payload: bytes, cuts: list[int]):
    import aiohttp

    seen: list[dict] = []
    server = await _serve(status, payload, cuts, seen)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            req = BenchRequest(prompt_token_ids=[5, 6, 7], max_tokens=4)
            result = await one_request(session, f"http://127.0.0.1:{port}/v1/completions", "m", req, [5, 6, 7], True)
    finally:
        server.close()
        await server.wait_closed()
    return result, seen


@pytest.mark.parametrize("crlf", [False, True])
def test_every_choice_chunk_counts_wherever_the_stream_is_cut(crlf):
    texts = ["a", "", "b", "c"]  # a chunk without text still counts (a server holding back a token's text)
    payload = _events(texts, 4, crlf)
    # Cut inside the first line, between events, in the middle of "data: ", and right after the usage line.
    cuts = sorted({7, payload.index(b"data: ", 20) + 3, len(payload) // 2, len(payload) - 9})
    result, seen = asyncio.run(_request(200, payload, cuts))
    assert result.ok, result.error
    assert result.output_tokens == 4 and result.prompt_tokens == 3
    assert result.ttft > 0 and len(result.itls) == len(texts) - 1
    assert all(gap >= 0 for gap in result.itls) and result.e2el >= result.ttft + sum(result.itls) * 0.99
    assert seen == [{"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "stream": True,
                     "stream_options": {"include_usage": True}, "ignore_eos": True}]  # fmt: skip


def test_without_usage_the_chunks_are_the_tokens():
    payload = b"".join(b"data: %s\n\n" % json.dumps({"choices": [{"text": t}]}).encode() for t in "xyz")
    result, _ = asyncio.run(_request(200, payload + b"data: [DONE]\n\n", [5, 30]))
    assert result.ok and result.output_tokens == 3 and len(result.itls) == 2


def test_an_error_status_is_a_failed_request_with_the_body():
    result, _ = asyncio.run(_request(400, b'{"error": {"message": "max_tokens is too large"}}', []))
    assert not result.ok and result.error.startswith("HTTP 400") and "max_tokens is too large" in result.error
