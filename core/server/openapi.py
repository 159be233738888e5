"""The OpenAPI 3.1 description of the server's routes, served at GET /openapi.json."""

from __future__ import annotations

from typing import Any

from core.server.protocol import (
    HARMLESS_FIELDS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    OFF_ALSO,
    OFF_STRINGS,
    REFUSED_FIELDS,
    SCHEMA_FIELDS,
    SEED_MAX,
    SEED_MIN,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": MAX_STOP}]}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

_SAMPLING = {
    "model": _STR, "stream": _BOOL, "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "max_tokens": {"type": "integer", "minimum": 1}, "min_tokens": {"type": "integer",
                                                                    "minimum": 0},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1}, "min_p": _NUM,
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": _NUM, "stop": _STOP, "stop_token_ids": _IDS, "ignore_eos": _BOOL,
    "seed": {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX},
    "skip_special_tokens": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N,
                "description": "only equal to n"},
    "logit_bias": {"type": "object", "maxProperties": 0, "description": "not supported: "
                   "only an empty object"},
    **{name: {**_STR, "description": "informational; accepted and not acted on"}
       for name in HARMLESS_FIELDS},
}
# A field peers define that this server does not implement: only values asking for nothing.
_OFF_DOC = ("not supported: accepted only with a value that asks for nothing (null, false, "
            "empty, or the values listed); anything else is a 400 (code unsupported)")


def _off(name: str) -> dict[str, Any]:
    ok: list[dict[str, Any]] = [{"type": "null"}, {"const": False},
                                {"type": "array", "maxItems": 0}]
    if name not in SCHEMA_FIELDS:
        ok.append({"type": "object", "maxProperties": 0})
    if name in OFF_STRINGS:
        ok.append({"enum": list(OFF_STRINGS[name])})
    ok += [{"const": v} for v in OFF_ALSO.get(name, ())]
    return {"anyOf": ok, "description": _OFF_DOC}


def _refused(route: str) -> dict[str, Any]:
    return {name: _off(name) for name in sorted(REFUSED_FIELDS[route])}


_FIELD_POLICY = ("Unknown fields are refused with 400 (code unknown_parameter), whatever their "
                 "value; fields marked not supported are taken only with their off value.")

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "properties": {"message": _STR, "type": _STR,
                                         "param": {"type": ["string", "null"]},
                                         "code": {"type": ["string", "null"]}}}}},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "additionalProperties": False,
                          "description": _FIELD_POLICY, "properties": {
        **_SAMPLING, **_refused("completions"),
        "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR}, _IDS,
                             {"type": "array", "items": _IDS}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        "echo": _BOOL}},
    "ChatMessage": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": {
            "type": "object", "properties": {"type": {"const": "text"}, "text": _STR}}}]},
        "name": _STR}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"],
                              "additionalProperties": False, "description": _FIELD_POLICY,
                              "properties": {
        **_SAMPLING, **_refused("chat"), "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "max_completion_tokens": {"type": "integer", "minimum": 1}, "logprobs": _BOOL,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        "add_generation_prompt": _BOOL}},
    "GenerateRequest": {"type": "object", "additionalProperties": False,
                        "description": _FIELD_POLICY, "properties": {
        **_refused("generate"),
        "text": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
        "input_ids": {"oneOf": [_IDS, {"type": "array", "items": _IDS}]},
        "sampling_params": {"type": "object", "properties": {
            "max_new_tokens": _INT, "min_new_tokens": _INT, "temperature": _NUM, "top_p": _NUM,
            "top_k": _INT, "min_p": _NUM, "frequency_penalty": _NUM, "presence_penalty": _NUM,
            "repetition_penalty": _NUM, "stop": _STOP, "stop_token_ids": _IDS,
            "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "n": _INT,
            "seed": {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX},
            "sampling_seed": {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}},
            "additionalProperties": False},
        "stream": _BOOL, "return_logprob": _BOOL, "top_logprobs_num": _INT, "rid": _STR}},
}

_ERRORS = {str(code): {"description": why, "content": {"application/json": {
    "schema": _ref("Error")}}}
    for code, why in ((400, "invalid parameter, prompt too long for the context, bad JSON"),
                      (401, "missing or wrong API key"), (404, "unknown model"),
                      (413, "request body over --max-request-bytes"),
                      (503, "queue full, shutting down or engine unavailable "
                            "(with Retry-After)"))}


def _post(summary: str, schema: str, streams: bool = True) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": _STR, "description": "server-sent events, each "
                                   "`data: <json>`, ending with `data: [DONE]`"}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(schema)}}},
        "responses": {"200": {"description": "the result", "content": ok}, **_ERRORS}}}


def _get(summary: str, public: bool = False, content: str = "application/json"
         ) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": {
        "description": "ok", "content": {content: {"schema": {"type": "object"}
                                                   if content == "application/json"
                                                   else _STR}}}}}
    if public:
        op["security"] = []
    return {"get": op}


def openapi_spec(version: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "core-serve", "version": version,
                 "description": "OpenAI-compatible and SGLang-native LLM serving API"},
        "components": {"schemas": _SCHEMAS, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "required when the server runs with --api-key"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": _post("text completion (OpenAI)", "CompletionRequest"),
            "/v1/chat/completions": _post("chat completion with the model's chat template "
                                          "(OpenAI)", "ChatCompletionRequest"),
            "/generate": _post("native generation (SGLang): text or input_ids",
                               "GenerateRequest"),
            "/v1/models": _get("the served model (OpenAI list)"),
            "/v1/models/{model}": _get("one model"),
            "/health": _get("liveness: 200 while the engine process is alive and beating, "
                            "busy or not (never waits for a scheduler step); 503 when it is "
                            "gone or the server is draining", public=True),
            "/ready": _get("readiness: 200 when live, not draining and below the admission "
                           "limit (--max-running-requests + --max-queued-requests); 503 with "
                           "status busy / draining / engine_unavailable otherwise",
                           public=True),
            "/health_generate": _get("one token end to end through the scheduler: 200 ok, "
                                     "503 busy (the engine queue is full) or "
                                     "engine_unavailable; at most one probe runs at a time and "
                                     "its answer is reused for 2 s; needs the API key"),
            "/get_model_info": _get("model path, architecture, context length"),
            "/get_server_info": _get("server arguments, resolved plan, candidate table, live "
                                     "figures"),
            "/metrics": _get("Prometheus text format", public=True, content="text/plain"),
            "/openapi.json": _get("this description"),
        },
    }
