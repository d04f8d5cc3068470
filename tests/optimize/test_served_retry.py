"""The load's client against a server that closes kept-alive connections (as llama-server does): a
request whose connection closes before any response is sent again, up to CONNECTION_RETRIES times,
its time to first token counted from the first try; one that keeps failing, or that fails once the
response has begun, is a failure. A raw HTTP/1.1 server on loopback plays the server."""

from __future__ import annotations

import asyncio
import json

from optimize.evaluate.served import CONNECTION_RETRIES, one_request, summarize

TEXT_CHUNKS = ["Hello", " world"]


def _stream_body() -> bytes:
    events = [{"choices": [{"text": t, "finish_reason": None}]} for t in TEXT_CHUNKS]
    events.append({"choices": [{"text": "", "finish_reason": "stop"}], "usage": {"completion_tokens": 2}})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def _serve(drop_first: int, cut_midway: bool = False):
    """A server that reads each request and closes the first `drop_first` connections unanswered;
    later ones get a streamed completion (cut after the headers and one event with `cut_midway`)."""
    seen = {"connections": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
        )
        await reader.readexactly(length)
        if seen["connections"] <= drop_first:
            writer.close()
            return
        body = _stream_body()
        if cut_midway:
            body = body.split(b"\n\n")[0] + b"\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"content-length: %d\r\n\r\n" % (len(body) + (100 if cut_midway else 0)) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


async def _one(drop_first: int, cut_midway: bool = False):
    import httpx

    server, url, seen = await _serve(drop_first, cut_midway)
    async with server, httpx.AsyncClient(timeout=10) as client:
        result = await one_request(client, url, "m", [1, 2, 3], 2)
    return result, seen["connections"]


def test_a_connection_closed_before_any_response_is_sent_again():
    result, connections = asyncio.run(_one(drop_first=1))
    assert connections == 2 and result.retries == 1
    assert result.status == 200 and not result.error
    assert result.text == "Hello world" and result.tokens == 2 and result.finish_reason == "stop"
    summary = summarize([result], 1.0, 1)
    assert summary["failed"] == 0 and summary["retried"] == 1


def test_a_server_that_keeps_closing_fails_after_the_retries():
    result, connections = asyncio.run(_one(drop_first=CONNECTION_RETRIES + 1))
    assert connections == CONNECTION_RETRIES + 1 and result.retries == CONNECTION_RETRIES
    assert result.error.startswith("RemoteProtocolError") and result.status == 0
    assert summarize([result], 1.0, 1)["failed"] == 1


def test_a_stream_cut_after_it_began_is_a_failure_not_sent_again():
    result, connections = asyncio.run(_one(drop_first=0, cut_midway=True))
    assert connections == 1 and result.retries == 0
    assert result.status == 200 and result.error.startswith("RemoteProtocolError")
    assert result.text == "Hello"  # what came before the cut is kept
    assert summarize([result], 1.0, 1)["failed"] == 1
