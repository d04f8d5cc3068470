"""Reading request bodies within the size limit, compressed ones included."""

from __future__ import annotations

import contextlib
import zlib

from starlette.requests import Request

from serve.errors import HTTPError, too_large

# The most characters one token is taken to stand for, in the length checks made before a tokenizer sees
# a text: a text over its limit in tokens times this is refused (or, where the client asks to truncate,
# cut to that) before it is tokenized, so no request makes the server tokenize more than a context's
# worth of text (a 4 MB prompt took the event loop for half a second). Byte-level BPE tokens are a
# few characters on average; a long run of spaces is the longest in common vocabularies.
MAX_CHARS_PER_TOKEN = 32

# zlib window bits: 16+ reads gzip, a plain value reads the zlib stream HTTP calls "deflate".
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit` bytes (before or after inflating)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "identity":
        return body
    if encoding not in WBITS:
        raise HTTPError(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate or none)")
    return inflate(body, WBITS[encoding], limit)


def inflate(body: bytes, wbits: int, limit: int) -> bytes:
    """Decompress at most `limit` bytes: a small compressed body must not expand without bound."""
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise HTTPError(400, f"the body could not be decompressed: {exc}") from None
    if len(out) > limit:
        raise too_large(limit)
    return out


@contextlib.contextmanager
def arriving(batcher):
    """Mark a request as on its way to the batcher, so a forming batch waits for it."""
    if batcher is None:
        yield
        return
    batcher.arriving += 1
    try:
        yield
    finally:
        batcher.arriving -= 1
