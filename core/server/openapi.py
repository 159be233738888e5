"""The OpenAPI 3.1 description of the server's routes, served at GET /openapi.json.

The request schemas say what the parsers in `core.server.protocol` take, with the served model's
limits (context length, vocabulary) where the server knows them: a body the schema accepts is one
the server accepts, except for the rules JSON Schema cannot say (prompt tokens + max_tokens
within the context, min_tokens <= max_tokens, best_of == n, prompts x n <= 64, the chat template's
own refusals), which the descriptions name. `tests/test_openapi.py` holds the two to each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.server.protocol import (
    CHAT_ROLES,
    HARMLESS_FIELDS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS,
    MAX_TEMPLATE_KWARGS_BYTES,
    MESSAGE_REFUSED_FIELDS,
    NATIVE_SAMPLING_KEYS,
    OFF_ALSO,
    OFF_STRINGS,
    REFUSED_FIELDS,
    RESERVED_TEMPLATE_VARS,
    SCHEMA_FIELDS,
    SEED_MAX,
    SEED_MIN,
)
from core.server.state import RID_PATTERN
from core.server.tools import MAX_TOOLS, NAME

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject


def _ref(name: str) -> JSONObject:
    return {"$ref": f"#/components/schemas/{name}"}


_NUM: JSONObject = {"type": "number"}
_BOOL: JSONObject = {"type": "boolean"}
_STR: JSONObject = {"type": "string"}
_SEED: JSONObject = {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}
_STOP_STR: JSONObject = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_STOP: JSONObject = {"oneOf": [_STOP_STR, {"type": "array", "items": _STOP_STR,
                                           "maxItems": MAX_STOP}]}
_TEXT: JSONObject = {"type": "string", "minLength": 1}  # an empty prompt is refused (0 tokens)

# A field peers define that this server does not implement: only values asking for nothing.
_OFF_DOC = ("not supported: accepted only with a value that asks for nothing (null, false, "
            "empty, or the values listed); anything else is a 400 (code unsupported)")
_LOGIT_BIAS: JSONObject = {
    "type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": 1024,
    "description": "token id -> bias added to its logit before sampling"}
_FIELD_POLICY = ("Unknown fields are refused with 400 (code unknown_parameter), whatever their "
                 "value; fields marked not supported are taken only with a value that asks for "
                 "nothing (code unsupported otherwise).")


def _off(name: str) -> JSONObject:
    ok: list[JSON] = [{"type": "null"}, {"const": False}, {"type": "array", "maxItems": 0}]
    if name not in SCHEMA_FIELDS:
        ok.append({"type": "object", "maxProperties": 0})
    if name in OFF_STRINGS:
        ok.append({"enum": list(OFF_STRINGS[name])})
    ok += [{"const": v} for v in OFF_ALSO.get(name, ())]
    return {"anyOf": ok, "description": _OFF_DOC}


_GRAMMAR_DOC = ("structured output: at most one constraint per request; one the server's "
                "grammar backend cannot compile (invalid schema or regex, a schema keyword it "
                "cannot enforce), or any constraint while structured output is off "
                "(--grammar-backend none), is a 400 naming the problem")


def _structured() -> JSONObject:
    """The structured-output fields (core.server.structured) of the OpenAI routes."""
    text: JSONObject = {**_STR, "minLength": 1, "description": _GRAMMAR_DOC}
    schema: JSONObject = {"oneOf": [_STR, {"type": "object"}, _BOOL],
                          "description": "a JSON schema (or its JSON text); " + _GRAMMAR_DOC}
    choice: JSONObject = {"type": "array", "items": {**_STR, "minLength": 1}, "minItems": 1,
                          "description": _GRAMMAR_DOC}
    rf_schema: JSONObject = {
        "type": "object", "required": ["schema"], "additionalProperties": False,
        "properties": {"name": _STR, "description": _STR, "strict": _BOOL,
                       "schema": {"oneOf": [{"type": "object"}, _BOOL]}}}
    response_format: JSONObject = {"oneOf": [
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
         "properties": {"type": {"const": "json_schema"}, "json_schema": rf_schema}},
        {"type": "object", "required": ["type", "structures", "triggers"],
         "additionalProperties": False, "description": "free text; a trigger opens one of the "
         "structures that begin with it (its JSON schema, then its end); grammar backends "
         "that declare structural_tag (xgrammar)",
         "properties": {"type": {"const": "structural_tag"},
                        "structures": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["begin", "schema", "end"],
                            "additionalProperties": False,
                            "properties": {"begin": {**_STR, "minLength": 1}, "end": _STR,
                                           "schema": {"oneOf": [{"type": "object"}, _BOOL]}}}},
                        "triggers": {"type": "array", "minItems": 1,
                                     "items": {**_STR, "minLength": 1}}}}],
        "description": _GRAMMAR_DOC}
    outputs: JSONObject = {
        "type": "object", "additionalProperties": False, "description": _GRAMMAR_DOC,
        "properties": {"json": schema, "regex": text, "choice": choice, "grammar": text,
                       "json_object": {"const": True}}}
    return {"response_format": response_format, "regex": text, "ebnf": text,
            "json_schema": schema, "guided_json": schema, "guided_regex": text,
            "guided_choice": choice, "guided_grammar": text, "structured_outputs": outputs}


_TOOLS_DOC = ("tool calling (core.server.tools): function names unique; tool_choice \"auto\" "
              "(the default with tools) parses calls out of the answer with the server's "
              "tool-call parser (a 400 under --tool-call-parser none) and refuses strict "
              "functions; \"required\" and a named function (which must be in tools) are "
              "constrained by the grammar backend; \"none\" parses nothing; with tools and a "
              "choice other than none, a structured-output field is a 400")


def _reasoning() -> JSONObject:
    """separate_reasoning, stream_reasoning, chat_template_kwargs (core.server.reasoning)."""
    return {
        "separate_reasoning": {**_BOOL, "description": "SGLang's: true (the default with a "
                               "reasoning parser) puts the reasoning in "
                               "message.reasoning_content / delta.reasoning_content, apart from "
                               "content; true without --reasoning-parser is a 400"},
        "stream_reasoning": {**_BOOL, "description": "SGLang's: false sends the streamed "
                             "reasoning in one delta once it ends; needs a reasoning parser"},
        "chat_template_kwargs": {
            "type": "object", "maxProperties": MAX_TEMPLATE_KWARGS,
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$",
                              "not": {"enum": sorted(RESERVED_TEMPLATE_VARS)}},
            "description": "extra chat-template variables (Qwen3's enable_thinking: false "
                           "turns thinking off, the output is then all content); the template "
                           f"must read each; at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON"}}


def _tools() -> JSONObject:
    """tools, tool_choice, parallel_tool_calls (core.server.tools.parse_tools)."""
    function: JSONObject = {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"oneOf": [{"type": "null"}, {
                "type": "object", "properties": {"type": {"const": "object"}},
                "description": "the JSON schema of the arguments object (absent: no "
                               "arguments)"}]},
            "strict": {"type": ["boolean", "null"],
                       "description": "enforced under required / a named choice; "
                                      "refused under auto"}}}
    tool: JSONObject = {
        "type": "object", "required": ["type", "function"], "additionalProperties": False,
        "properties": {"type": {"const": "function"}, "function": function}}
    named: JSONObject = {
        "type": "object", "required": ["type", "function"], "additionalProperties": False,
        "properties": {"type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": _STR}}}}
    return {"tools": {"oneOf": [{"type": "null"}, {"type": "array", "maxItems": MAX_TOOLS,
                                                   "items": tool}],
                      "description": _TOOLS_DOC},
            "tool_choice": {"oneOf": [{"type": "null"}, {"enum": ["none", "auto", "required"]},
                                      named],
                            "description": "required or a named function need tools; "
                                           + _TOOLS_DOC},
            "parallel_tool_calls": {**_BOOL, "description": "false: at most one call"}}


def _message() -> JSONObject:
    text_part: JSONObject = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": _STR}}
    call: JSONObject = {
        "type": "object", "required": ["id", "function"], "additionalProperties": False,
        "properties": {"id": _STR, "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name", "arguments"],
            "additionalProperties": False, "properties": {
                "name": {**_STR, "minLength": 1},
                "arguments": {**_STR, "description": "the JSON text of an object"}}}}}
    no_calls: JSONObject = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    calls_something: JSONObject = {"required": ["tool_calls"], "properties": {
        "role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}}
    return {"type": "object", "required": ["role"], "additionalProperties": False,
            "properties": {
                "role": {"enum": list(CHAT_ROLES)},
                "content": {"oneOf": [_STR, {"type": "array", "items": text_part},
                                      {"type": "null"}],
                            "description": "required, except for an assistant turn that only "
                                           "calls tools; text that spells one of the "
                                           "tokenizer's special tokens is refused unless the "
                                           "server runs with --allow-special-tokens-in-messages"},
                "name": _STR,
                "tool_calls": {"oneOf": [{"type": "null"}, {"type": "array", "items": call}],
                               "description": "assistant messages only"},
                "tool_call_id": {"type": ["string", "null"],
                                 "description": "tool messages: the call answered"},
                "reasoning_content": {"type": ["string", "null"],
                                      "description": "assistant messages only: a reply's "
                                                     "reasoning replayed, for the chat template "
                                                     "(Qwen3's shows the latest turn's)"},
                **{n: _off(n) for n in sorted(MESSAGE_REFUSED_FIELDS)}},
            "allOf": [
                {"if": {"not": calls_something}, "then": {
                    "required": ["content"],
                    "properties": {"content": {"not": {"type": "null"}}}}},
                {"if": {"properties": {"role": {"const": "tool"}}},
                 "then": {"required": ["tool_call_id"],
                          "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
                 "else": {"properties": {"tool_call_id": {"type": "null"}}}},
                {"if": {"not": {"properties": {"role": {"const": "assistant"}}}},
                 "then": {"properties": {"tool_calls": no_calls}}}]}


def _schemas(context: int | None, vocab: int | None) -> JSONObject:
    tok_id: JSONObject = {"type": "integer", "minimum": 0}
    if vocab:
        tok_id["maximum"] = vocab - 1
    ids: JSONObject = {"type": "array", "items": tok_id, "minItems": 1}
    max_tokens: JSONObject = {"type": "integer", "minimum": 1}
    count: JSONObject = {"type": "integer", "minimum": 0}
    if context:
        max_tokens["maximum"] = count["maximum"] = context
        max_tokens["description"] = (f"prompt tokens + this must fit the context ({context} "
                                     "tokens)")
    top_k: JSONObject = {"type": "integer", "minimum": -1, "not": {"const": 0},
                         "description": "-1: off"}
    if vocab:
        top_k["maximum"] = vocab
    common: JSONObject = {
        "model": _STR, "stream": _BOOL, "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N,
                    "description": "only equal to n"},
        "max_tokens": max_tokens, "min_tokens": {**count, "description": "at most max_tokens"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "top_k": top_k,
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
        "stop": _STOP, "stop_token_ids": {**ids, "minItems": 0, "maxItems": MAX_STOP_TOKEN_IDS},
        "ignore_eos": _BOOL, "seed": _SEED, "skip_special_tokens": _BOOL,
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": _BOOL}},
        "logit_bias": _LOGIT_BIAS,
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                            "description": "vLLM's: the logprob of each prompt token after the "
                                           "first and this many alternatives (prompt_logprobs "
                                           "in the response); such a request reuses no cached "
                                           "prefix"},
        "return_token_ids": {**_BOOL, "description": "vLLM's: prompt_token_ids and token_ids "
                                                     "in the response"},
        **{name: {**_STR, "description": "informational; accepted and not acted on"}
           for name in HARMLESS_FIELDS},
        **_structured(),
    }
    # stream_options only with stream=true
    only_streamed: JSONObject = {"stream_options": {"required": ["stream"],
                                                    "properties": {"stream": {"const": True}}}}

    def request(route: str, required: list[str], own: JSONObject, **extra: JSON
                ) -> JSONObject:
        props = {**{n: _off(n) for n in sorted(REFUSED_FIELDS[route])}, **own}
        return {"type": "object", "required": required, "additionalProperties": False,
                "description": _FIELD_POLICY, "properties": props, **extra}

    message = _message()
    sampling: JSONObject = {
        "max_new_tokens": max_tokens, "min_new_tokens": count,
        **{k: common[k] for k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                                  "presence_penalty", "repetition_penalty", "stop",
                                  "stop_token_ids", "ignore_eos", "skip_special_tokens",
                                  "seed")},
        "n": common["n"], "sampling_seed": _SEED, "logit_bias": _LOGIT_BIAS,
        **{k: common[k] for k in ("regex", "ebnf", "json_schema")},
    }
    assert set(sampling) == set(NATIVE_SAMPLING_KEYS), "the native sampling keys drifted"
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "properties": {"message": _STR, "type": _STR,
                                             "param": {"type": ["string", "null"]},
                                             "code": {"type": ["string", "null"]}}}}},
        "CompletionRequest": request("completions", ["prompt"], {
            **common,
            "prompt": {"oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1},
                                 ids, {"type": "array", "items": ids, "minItems": 1}]},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "echo": {**_BOOL, "description": "the prompt before the completion; with logprobs, "
                                             "the logprobs cover the prompt's tokens too (the "
                                             "first one null)"}},
            dependentSchemas=only_streamed),
        "ChatMessage": message,
        "ChatCompletionRequest": request("chat", ["messages"], {
            **common,
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                         "items": _ref("ChatMessage")},
            "max_completion_tokens": {**max_tokens, "description": "the same as max_tokens "
                                      "(when both are given they must be equal)"},
            "logprobs": _BOOL,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "add_generation_prompt": _BOOL, **_tools(), **_reasoning()},
            dependentSchemas={**only_streamed, "top_logprobs": {
                "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}),
        "GenerateRequest": request("generate", [], {
            "text": {"oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]},
            "input_ids": {"oneOf": [ids, {"type": "array", "items": ids, "minItems": 1}]},
            "sampling_params": {"type": "object", "additionalProperties": False,
                                "properties": sampling},
            "stream": _BOOL, "return_logprob": _BOOL,
            "logprob_start_len": {"type": "integer", "minimum": -1, "description":
                                  "with return_logprob: input_token_logprobs from this prompt "
                                  "position (-1, the default: none)"},
            "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "lora_path": {"oneOf": [_STR, {"type": "array", "items": {
                "type": ["string", "null"]}}, {"type": "null"}], "description":
                "the loaded LoRA adapter serving every prompt, or one per prompt (null: the "
                "base model); an adapter not loaded is a 404, with LoRA off a 400"},
            "rid": {"type": "string", "pattern": f"^{RID_PATTERN.pattern}$",
                    "description": "for one prompt only; must not be in use (with its "
                                   "`<rid>-i` children)"}},
            oneOf=[{"required": ["text"], "not": {"required": ["input_ids"]}},
                   {"required": ["input_ids"], "not": {"required": ["text"]}}]),
    }


def _error(why: str) -> JSONObject:
    return {"description": why, "content": {"application/json": {"schema": _ref("Error")}}}


_UNAUTHORIZED = _error("missing or wrong API key (when the server runs with one); carries "
                       "WWW-Authenticate: Bearer")
_POST_ERRORS = {
    "400": _error("invalid or unknown parameter, prompt too long for the context, bad JSON"),
    "401": _UNAUTHORIZED, "404": _error("unknown model"),
    "413": _error("request body over --max-request-bytes"),
    "415": _error("the body is not sent as application/json"),
    "503": _error("queue full, shutting down or engine unavailable (with Retry-After)"),
}


def _post(summary: str, schema: str) -> JSONObject:
    ok: JSONObject = {
        "application/json": {"schema": {"type": "object"}},
        # OpenAPI's media type object has no description; the summary says what streams
        "text/event-stream": {"schema": _STR}}
    return {"post": {
        "summary": summary + "; with stream=true, server-sent events (each `data: <json>`) "
                             "ending with `data: [DONE]`",
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref(schema)}}},
        "responses": {"200": {"description": "the result", "content": ok}, **_POST_ERRORS}}}


def _lora_admin(summary: str, load: bool) -> JSONObject:
    props: JSONObject = {"lora_name": {"type": "string", "minLength": 1, "maxLength": 256}}
    if load:
        props["lora_path"] = {"type": "string", "minLength": 1,
                              "description": "the PEFT adapter's folder on the server"}
    body = {"type": "object", "additionalProperties": False,
            "required": sorted(props), "properties": props}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": body}}},
        "responses": {"200": {"description": "done: the adapters loaded now", "content": {
            "application/json": {"schema": {"type": "object"}}}},
            "400": _error("a malformed body, LoRA off, an adapter that cannot be served (the "
                          "message names the problem), a name taken, an adapter in use"),
            "401": _UNAUTHORIZED, "404": _error("unload: no adapter of that name"),
            "503": _error("engine unavailable")}}}


def _get(summary: str, public: bool = False, content: str = "application/json",
         unavailable: bool = False, not_found: str | None = None) -> JSONObject:
    schema: JSONObject = {"type": "object"} if content == "application/json" else _STR
    responses: JSONObject = {"200": {"description": "ok", "content": {
        content: {"schema": schema}}}}
    if not public:
        responses["401"] = _UNAUTHORIZED
    if not_found:
        responses["404"] = _error(not_found)
    if unavailable:
        responses["503"] = _error("not live / not ready (the body says which)")
    op: JSONObject = {"summary": summary, "responses": responses}
    if public:
        op["security"] = []
    return {"get": op}


def openapi_spec(version: str, context_length: int | None = None,
                 vocab_size: int | None = None) -> JSONObject:
    """The document; with the served model's context length and vocabulary size, the limits
    that depend on them are in the schemas too."""
    model_param: JSONObject = {"name": "model", "in": "path", "required": True, "schema": _STR,
                               "description": "the served model's name"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "core-serve", "version": version,
                 "description": "OpenAI-compatible and SGLang-native LLM serving API. "
                                + _FIELD_POLICY},
        "components": {"schemas": _schemas(context_length, vocab_size), "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "required when the server runs with --api-key"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": _post("text completion (OpenAI)", "CompletionRequest"),
            "/v1/chat/completions": _post("chat completion with the model's chat template "
                                          "(OpenAI)", "ChatCompletionRequest"),
            "/generate": _post("native generation (SGLang): text or input_ids",
                               "GenerateRequest"),
            "/v1/models": _get("the served model and its LoRA adapters (OpenAI list; an "
                               "adapter's parent is the served model)"),
            "/v1/models/{model}": {"parameters": [model_param], **_get(
                "one model", not_found="no model of that name is served")},
            **{f"{prefix}/load_lora_adapter": _lora_admin(
                "load a PEFT LoRA adapter while serving (needs --enable-lora; the API key "
                "guards it)", load=True) for prefix in ("", "/v1")},
            **{f"{prefix}/unload_lora_adapter": _lora_admin(
                "forget a LoRA adapter (refused while requests use it)", load=False)
               for prefix in ("", "/v1")},
            "/health": _get("liveness: 200 while the engine process is alive and beating, "
                            "busy or not (never waits for a scheduler step); 503 when it is "
                            "gone or the server is draining", public=True, unavailable=True),
            "/ready": _get("readiness: 200 when live, not draining and below the admission "
                           "limit (--max-running-requests + --max-queued-requests); 503 with "
                           "status busy / draining / engine_unavailable otherwise",
                           public=True, unavailable=True),
            "/health_generate": _get("one token end to end through the scheduler: 200 ok, "
                                     "503 busy (the engine queue is full) or "
                                     "engine_unavailable; at most one probe runs at a time and "
                                     "its answer is reused for 2 s; needs the API key",
                                     unavailable=True),
            "/get_model_info": _get("model path, architecture, context length"),
            "/get_server_info": _get("server arguments, resolved plan, candidate table, live "
                                     "figures"),
            "/metrics": _get("Prometheus text format", public=True, content="text/plain"),
            "/openapi.json": _get("this description"),
        },
    }
