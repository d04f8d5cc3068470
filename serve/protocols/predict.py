"""/predict, shaped like Text Embeddings Inference's classification route, which users already call:

    POST /predict {"inputs": "text"}            -> [{"label": "torch", "score": 0.97}, ...]
    POST /predict {"inputs": ["a", "b"]}        -> [[{"label": ..., "score": ...}, ...], [...]]

Every label comes back with its softmax score, highest first (`raw_scores: true`: the logits
instead). A text longer than the model takes is refused with 422 unless `truncate: true`, as TEI
does. Sentence pairs (TEI's [["a", "b"]]) are not taken: the classifiers here are single-text ones.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.routing import Route

from serve.body import arriving, read_body
from serve.encoder.classifier import TextClassifierModel
from serve.encoder.model import run_encoder
from serve.errors import bad_request, openai_error_body
from serve.protocols.jsonbody import FastJSONResponse
from serve.protocols.openapi import errors, json_body
from serve.protocols.parsing import get_bool, json_object
from serve.protocols.spec import ProtocolSpec
from serve.state import state_of


def routes() -> list[Route]:
    return [Route("/predict", predict, methods=["POST"])]


def parse_inputs(data: dict, max_inputs: int) -> tuple[list[str], bool]:
    """(texts, whether one text was sent, not a list)."""
    raw = data.get("inputs")
    if isinstance(raw, str):
        return [raw], True
    if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        if len(raw) > max_inputs:
            raise bad_request(f"'inputs' has {len(raw)} texts; at most {max_inputs} per request", param="inputs")
        return raw, False
    raise bad_request("'inputs' must be a string or a non-empty list of strings", param="inputs")


async def predict(request: Request) -> FastJSONResponse:
    state = state_of(request)
    state.require_answers("predict")
    with arriving(state.batcher):
        data = json_object(await read_body(request, state.config.max_request_bytes))
        texts, single = parse_inputs(data, state.config.max_inputs)
        raw_scores, truncate = get_bool(data, "raw_scores"), get_bool(data, "truncate")
        model = state.ready_model(TextClassifierModel)
        # Tokenizing in a worker thread: the event loop goes on serving meanwhile.
        item = await asyncio.to_thread(model.from_texts_checked, texts, truncate)
    state.metrics.prompt_tokens.inc(int(item.inputs["attention_mask"].sum()))
    logits = (await run_encoder(state, item))["logits"]
    rows = model.predictions(logits, raw_scores)
    return FastJSONResponse(rows[0] if single else rows)


# --- the protocol: routes, OpenAPI paths, error body ----------------------------------------------

PREDICT_ERRORS = (400, 405, 413, 415, 422, 429, 503, 504)
LABEL_SCORE = {
    "type": "object",
    "required": ["label", "score"],
    "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
}
PREDICT_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "inputs": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]},
        "raw_scores": {"type": "boolean"},
        "truncate": {"type": "boolean"},
    },
}
PREDICT_RESPONSE = {
    "anyOf": [
        {"type": "array", "items": LABEL_SCORE},
        {"type": "array", "items": {"type": "array", "items": LABEL_SCORE}},
    ]
}


def predict_paths(state) -> dict:
    return {
        "/predict": {
            "post": {
                "tags": ["predict"],
                "summary": "text classification, shaped like Text Embeddings Inference's /predict (classifiers)",
                "requestBody": {"required": True, **json_body(PREDICT_REQUEST)},
                "responses": {
                    "200": {
                        "description": "every label with its score, highest first (a list per text for a list)",
                        **json_body(PREDICT_RESPONSE),
                    },
                    **errors("OpenAIError", *PREDICT_ERRORS),
                },
            }
        }
    }


SPEC = ProtocolSpec("predict", routes, predict_paths, openai_error_body)
