"""Server and engine arguments: one frozen dataclass, SGLang's flag names, grouped --help.

Backend names (attention, MoE runner, quantization, device) are open strings checked by the resolver
against what is registered; only the core's own closed sets (dtype, load format, policies) are
validated here. The environment is read here too (`apply_environment`), never by the resolver.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm", "random", "lof", "priority")
EVICTION_POLICIES = ("lru", "lfu")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "prefix_aware")
DISABLE_FUSED_OPS_ENV = "CORE_DISABLE_FUSED_OPS"  # =1: --layer-ops torch unless the flag is given
SERVE_ITL_TARGET_MS = 50.0  # --decode-itl-target-ms under `core serve` (README: the prefill budget)


def _f(default: T, group: str, help: str, **kw: object) -> T:
    return field(default=default, metadata={"group": group, "help": help, **kw})


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = _f(None, "model", "model directory, config.json or .gguf file "
                                "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer_path: str | None = _f(None, "model", "tokenizer directory (default: model path)")
    load_format: str = _f("auto", "model", "weight format", choices=LOAD_FORMATS)
    dtype: str = _f("auto", "model", "compute dtype", choices=DTYPES)
    context_length: int | None = _f(None, "model", "override the model's context length")
    revision: str | None = _f(None, "model", "model revision (refused: models load from a local "
                              "path)")
    trust_remote_code: bool = _f(False, "model", "allow custom model code from the hub")
    seed: int = _f(0, "model", "seed for dummy weights and sampling")
    # http
    host: str = _f("127.0.0.1", "http", "address to listen on")
    port: int = _f(30000, "http", "port to listen on")
    api_key: str | None = _f(None, "http", "require this bearer key on API routes (visible in "
                             "the process list: prefer --api-key-file or CORE_API_KEY)")
    api_key_file: str | None = _f(None, "http", "read the bearer key from this file (one line)")
    served_model_name: str | None = _f(None, "http", "model name reported by the API")
    chat_template: str | None = _f(None, "http", "Jinja chat template file or string")
    tool_call_parser: str = _f("auto", "http", "tool-call parser for tool_choice auto in chat "
                               "(hermes, llama3, their SGLang/vLLM names, or a plugin's; auto: "
                               "chosen by the chat template's tool markup; none: auto tool "
                               "calls off)")
    reasoning_parser: str = _f("none", "http", "reasoning parser: chat answers carry the model's "
                               "reasoning in reasoning_content, apart from content (deepseek-r1, "
                               "qwen3, gpt-oss, their SGLang/vLLM names, or a plugin's; auto: "
                               "chosen by the chat template's markers; none: off, the reasoning "
                               "stays in content)")
    allow_special_tokens_in_messages: bool = _f(
        False, "http", "let chat message text spell the tokenizer's special tokens (e.g. "
        "<|im_start|>), which the template would turn into real control tokens; refused "
        "with a 400 otherwise")
    max_request_bytes: int = _f(1 << 20, "http", "largest accepted request body")
    log_requests: bool = _f(False, "http", "log every request")
    enable_cache_report: bool = _f(False, "http", "report cached prompt tokens in usage")
    drain_timeout: float = _f(30.0, "http", "seconds to let requests finish on SIGTERM")
    # memory and scheduling
    mem_fraction_static: float | None = _f(None, "scheduling", "fraction of free device memory "
                                           "for weights + KV cache")
    max_total_tokens: int | None = _f(None, "scheduling", "KV-cache size in tokens")
    max_running_requests: int | None = _f(None, "scheduling", "most requests decoded at once")
    max_queued_requests: int | None = _f(None, "scheduling", "most waiting requests; beyond, "
                                         "rejected")
    chunked_prefill_size: int | None = _f(None, "scheduling", "prefill chunk in tokens "
                                          "(-1 disables)")
    max_prefill_tokens: int = _f(16384, "scheduling", "most prompt tokens in one prefill batch")
    decode_itl_target_ms: float | None = _f(
        None, "scheduling", "prefill budget: while requests decode, each step extends only the "
        "prompt tokens the measured extend rate fits into this many ms after the decode step "
        "(at least 256 tokens and the decode step's time; at most --chunked-prefill-size), so "
        "long prompts arriving do not stall streaming; a time-sized, adaptive form of vLLM's "
        "--max-num-batched-tokens; 0: off, full chunks (default: 50 under `core serve` on an "
        "accelerator, off on a CPU and in the offline Engine; needs chunked prefill)")
    schedule_policy: str = _f("fcfs", "scheduling", "waiting-queue order",
                              choices=SCHEDULE_POLICIES)
    enable_priority_scheduling: bool = _f(False, "scheduling", "honour request priority")
    priority_scheduling_preemption_threshold: int = _f(
        10, "scheduling", "with priority scheduling, a waiting request that cannot be admitted "
        "preempts running requests whose priority is lower by at least this much")
    schedule_conservativeness: float = _f(1.0, "scheduling", "higher reserves more KV for "
                                          "decode")
    page_size: int | None = _f(None, "scheduling", "KV page size (default: what the backend "
                               "needs)")
    radix_eviction_policy: str = _f("lru", "scheduling", "prefix-cache eviction",
                                    choices=EVICTION_POLICIES)
    disable_radix_cache: bool = _f(False, "scheduling", "turn off prefix sharing")
    disable_hybrid_kv: bool = _f(False, "scheduling", "keep every layer's KV for the whole "
                                 "context (default for models with full and sliding-window "
                                 "layers: windowed layers give back pages out of their window)")
    swa_full_tokens_ratio: float = _f(0.8, "scheduling", "hybrid KV pool: sliding-window "
                                      "layers' KV tokens per full-attention layers' token, in "
                                      "(0, 1] (small: more long contexts fit, fewer short ones)")
    disable_overlap_schedule: bool = _f(False, "scheduling", "finish each decode step before "
                                        "launching the next (overlap is on for GPUs only)")
    # kernels
    device: str | None = _f(None, "kernels", "hardware target (cuda, rocm, xpu, npu, cpu, or a "
                            "plugin's)")
    device_profile: str | None = _f(None, "kernels", "plan for a simulated device: profile name "
                                    "or JSON file")
    attention_backend: str | None = _f(None, "kernels", "attention backend for both phases")
    prefill_attention_backend: str | None = _f(None, "kernels", "attention backend for prefill")
    decode_attention_backend: str | None = _f(None, "kernels", "attention backend for decode")
    moe_runner_backend: str = _f("auto", "kernels", "MoE runner")
    layer_ops: str | None = _f(None, "kernels", "fused element-wise layer ops (torch, triton, or a "
                               "plugin's; CORE_DISABLE_FUSED_OPS=1 means torch)")
    quantization: str | None = _f(None, "kernels", "quantization method")
    kv_cache_dtype: str = _f("auto", "kernels", "KV-cache storage dtype")
    grammar_backend: str = _f("auto", "kernels", "grammar backend for structured output "
                              "(xgrammar, llguidance, outlines, or a plugin's; auto: the best installed; "
                              "none: structured output off)")
    grammar_compile_timeout: float = _f(20.0, "kernels", "seconds a grammar may take to "
                                        "compile (in its compile process, queueing not "
                                        "counted); a slower one is refused with a 400")
    enable_jump_forward: bool = _f(False, "kernels", "append the tokens a grammar forces and "
                                   "compute them in one extend, not one decode step each "
                                   "(needs a grammar backend that can jump forward)")
    disable_cuda_graph: bool = _f(False, "kernels", "never capture CUDA graphs")
    cuda_graph_max_bs: int | None = _f(None, "kernels", "largest captured decode batch")
    # speculative decoding (core.contract.spec; core.engine.scheduler.spec verifies)
    speculative_algorithm: str | None = _f(
        None, "speculative", "speculative decoding proposer, case-insensitive: ngram (prompt "
        "lookup), suffix (the request and earlier outputs, SuffixDecoding-style), standalone "
        "(a draft model, --speculative-draft-model-path; vLLM's draft_model), or a plugin's; "
        "eagle is not implemented yet")
    speculative_num_draft_tokens: int | None = _f(
        None, "speculative", "most draft tokens per request and step (default: 4, at most the "
        "proposer's limit)")
    speculative_ngram_min_match_window_size: int = _f(
        1, "speculative", "ngram / suffix: shortest suffix of a request's tokens that must "
        "match earlier")
    speculative_ngram_max_match_window_size: int = _f(
        12, "speculative", "ngram / suffix: longest suffix tried (suffix: its index depth)")
    speculative_draft_model_path: str | None = _f(
        None, "speculative", "standalone: the draft model (directory, config.json or .gguf), "
        "sharing the target's tokenizer; loaded by the engine with a KV pool of its own")
    speculative_draft_load_format: str | None = _f(
        None, "speculative", "standalone: the draft's weight format (default: auto)",
        choices=LOAD_FORMATS)
    speculative_draft_model_quantization: str | None = _f(
        None, "speculative", "standalone: the draft's quantization method (default: chosen "
        "for the draft's checkpoint as --quantization is for the target's)")
    speculative_draft_attention_backend: str | None = _f(
        None, "speculative", "standalone: the draft's attention backend for both phases "
        "(default: as the target's, --attention-backend)")
    speculative_draft_model_revision: str | None = _f(
        None, "speculative", "standalone: the draft's revision (refused: models load from a "
        "local path)")
    speculative_governor: str | None = _f(
        None, "speculative", "on: each request's drafts per step cut to what its acceptance so "
        "far and the measured cost of a drafted token say pays, none where nothing does "
        "(seeded sampled requests are exempt, so their seeds repeat); off: always "
        "--speculative-num-draft-tokens. Default: on for a CPU device, off on an accelerator "
        "(not yet benchmarked there)",
        choices=("on", "off"))
    speculative_disable_by_batch_size: int | None = _f(
        None, "speculative", "no drafts in a step with more running requests than this (vLLM's "
        "disable_by_batch_size)")
    speculative_config: str | None = _f(
        None, "speculative", "vLLM's form, JSON: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1} "
        "or {\"method\": \"draft_model\", \"model\": PATH, \"quantization\": ...}, "
        "mapped onto the --speculative-* flags")
    # LoRA adapters (core.contract.lora; core.engine.lora holds them)
    enable_lora: bool = _f(False, "lora", "serve LoRA adapters of the base model (PEFT format); "
                           "implied by --lora-paths / --lora-modules")
    lora_paths: tuple[str, ...] | None = _f(
        None, "lora", "adapters loaded at start, SGLang's form: NAME=PATH ... (a bare PATH is "
        "named after its folder); a request selects one by name (OpenAI `model`, /generate's "
        "lora_path)", nargs="+")
    lora_modules: tuple[str, ...] | None = _f(
        None, "lora", "vLLM's form of --lora-paths: NAME=PATH ... or JSON objects "
        "{\"name\": ..., \"path\": ...}", nargs="+")
    max_loras_per_batch: int = _f(8, "lora", "adapter slots on the device: most distinct "
                                  "adapters in one batch (a request whose adapter finds no "
                                  "free slot waits; others go on)")
    max_lora_rank: int | None = _f(None, "lora", "largest adapter rank (default: the largest of "
                                   "the adapters loaded at start, 16 without any)")
    lora_target_modules: tuple[str, ...] | None = _f(
        None, "lora", "projections adapters may target: q_proj k_proj v_proj o_proj gate_proj "
        "up_proj down_proj, or all (default: those of the adapters loaded at start, all "
        "without any)", nargs="+")
    lora_backend: str = _f("auto", "lora", "LoRA backend (torch_native, triton, or a plugin's; "
                           "auto: the best that fits)")
    # parallelism (core.engine.distributed)
    tp_size: int = _f(1, "parallel", "tensor-parallel ranks per engine (heads, MLP and vocab "
                      "split; one all-reduce per row-parallel output)")
    dp_size: int = _f(1, "parallel", "data-parallel engine replicas behind the one HTTP server")
    ep_size: int = _f(1, "parallel", "expert-parallel size: MoE experts placed whole on ranks "
                      "(equal to --tp-size, or 1: experts' intermediate dim split over TP)")
    load_balance_method: str = _f("round_robin", "parallel", "how --dp-size picks a replica "
                                  "per request", choices=LOAD_BALANCE_METHODS)
    nnodes: int = _f(1, "parallel", "machines one tensor-parallel group spans")
    node_rank: int = _f(0, "parallel", "this machine's rank (0 serves HTTP; others only run "
                        "their ranks)")
    dist_init_addr: str | None = _f(None, "parallel", "host:port of rank 0's torch.distributed "
                                    "rendezvous (default: a free loopback port, one node)")

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


GROUP_TITLES = {
    "model": "model and tokenizer",
    "http": "HTTP server",
    "scheduling": "memory and scheduling",
    "kernels": "kernels and devices",
    "parallel": "parallelism (tensor, expert, data; several nodes)",
    "speculative": "speculative decoding",
    "lora": "LoRA adapters",
}


def add_cli_args(parser: argparse.ArgumentParser, groups: tuple[str, ...] = tuple(GROUP_TITLES)
                 ) -> None:
    """Add the fields of the chosen groups as --kebab-case flags, one argparse group each."""
    argument_groups = {g: parser.add_argument_group(GROUP_TITLES[g]) for g in groups}
    for f in dataclasses.fields(ServerArgs):
        group = f.metadata["group"]
        if group not in argument_groups:
            continue
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"],
                              "default": argparse.SUPPRESS}
        if f.type in ("bool", bool):
            kw["action"] = "store_true"
        else:
            kw["type"] = _ARG_TYPES.get(str(f.type), str)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:
                kw["nargs"] = f.metadata["nargs"]
        argument_groups[group].add_argument(flag, **kw)


_ARG_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float}


def from_namespace(ns: argparse.Namespace, base: dict[str, object] | None = None
                   ) -> ServerArgs:
    """Build ServerArgs from a YAML-file dict (if any) overridden by the flags that were given."""
    values = dict(base or {})
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    values.update({k: v for k, v in vars(ns).items() if k in names})
    return make_server_args(**values)


def make_server_args(**kwargs: Any) -> ServerArgs:
    """ServerArgs from keywords (dashes or underscores), with a clear error for unknown ones."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    clean = {k.replace("-", "_"): v for k, v in kwargs.items()}
    unknown = sorted(set(clean) - names)
    if unknown:
        raise ValueError(f"unknown argument(s): {', '.join(unknown)}")
    for name in LIST_FIELDS:  # a YAML list or JSON (the worker's copy) comes as a list
        value = clean.get(name)
        if isinstance(value, str):
            clean[name] = (value,)
        elif isinstance(value, list):
            clean[name] = tuple(value)
    args = apply_speculative_config(ServerArgs(**clean))
    validate(args)
    return apply_environment(args)


LIST_FIELDS = ("lora_paths", "lora_modules", "lora_target_modules")


# vLLM's --speculative-config keys and the flag each one sets
SPEC_CONFIG_KEYS = {"method": "speculative_algorithm",
                    "num_speculative_tokens": "speculative_num_draft_tokens",
                    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
                    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
                    "model": "speculative_draft_model_path",
                    "quantization": "speculative_draft_model_quantization",
                    "disable_by_batch_size": "speculative_disable_by_batch_size"}
SPEC_CONFIG_STRINGS = ("speculative_algorithm", "speculative_draft_model_path",
                       "speculative_draft_model_quantization")


def apply_speculative_config(args: ServerArgs) -> ServerArgs:
    """`args` with vLLM's --speculative-config JSON mapped onto the --speculative-* flags;
    a key this engine does not read, or one that contradicts a flag given too, is refused."""
    import json

    raw = args.speculative_config
    if raw is None:
        return args
    try:
        conf = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(conf, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4}')
    unknown = sorted(set(conf) - set(SPEC_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: key(s) {', '.join(unknown)} not supported here "
                         f"(supported: {', '.join(SPEC_CONFIG_KEYS)})")
    if "method" not in conf:
        raise ValueError('--speculative-config needs "method" (e.g. "ngram")')
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    changes: dict[str, object] = {}
    for key, name in SPEC_CONFIG_KEYS.items():
        if key not in conf:
            continue
        value, given = conf[key], getattr(args, name)
        if name not in SPEC_CONFIG_STRINGS and (isinstance(value, bool)
                                                or not isinstance(value, int)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
        if name in SPEC_CONFIG_STRINGS and not isinstance(value, str):
            raise ValueError(f"--speculative-config: {key} must be a string, got {value!r}")
        same = (given.lower() == value.lower() if isinstance(given, str) and
                isinstance(value, str) else given == value)
        if given != defaults[name] and not same:
            raise ValueError(f"--speculative-config {key}={value!r} contradicts "
                             f"--{name.replace('_', '-')} {given!r}")
        changes[name] = value
    return args.replace(**changes)


def apply_environment(args: ServerArgs, environ: Mapping[str, str] | None = None) -> ServerArgs:
    """`args` with what the environment sets where the flags left it open:
    CORE_DISABLE_FUSED_OPS=1 selects the PyTorch layer ops (--layer-ops torch)."""
    environ = os.environ if environ is None else environ
    if args.layer_ops is None and environ.get(DISABLE_FUSED_OPS_ENV) == "1":
        return args.replace(layer_ops="torch")
    return args


def load_yaml_config(path: str) -> dict[str, object]:
    import yaml

    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping of flag: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def validate(args: ServerArgs) -> None:
    """Check the core's own closed sets and ranges; backend names are the resolver's job."""
    for f in dataclasses.fields(ServerArgs):
        choices = f.metadata.get("choices")
        value = getattr(args, f.name)
        if choices and value is not None and value not in choices:
            raise ValueError(f"--{f.name.replace('_', '-')}: {value!r} is not one of "
                             f"{', '.join(choices)}")
    positive = ("max_total_tokens", "max_running_requests", "max_queued_requests", "page_size",
                "context_length", "cuda_graph_max_bs", "max_prefill_tokens", "tp_size",
                "dp_size", "ep_size", "nnodes")
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.swa_full_tokens_ratio <= 1:
        raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got "
                         f"{args.swa_full_tokens_ratio}")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got "
                         f"{args.mem_fraction_static}")
    if not 0 < args.grammar_compile_timeout <= 3600:
        raise ValueError(f"--grammar-compile-timeout must be in (0, 3600] seconds, got "
                         f"{args.grammar_compile_timeout}")
    if args.chunked_prefill_size is not None and args.chunked_prefill_size == 0:
        raise ValueError("--chunked-prefill-size must be positive or -1 (disabled)")
    _validate_itl_target(args)
    if args.api_key is not None and not args.api_key.strip():
        # an empty key must not read as "authentication off"
        raise ValueError("--api-key is empty; give a key, or leave the flag out to serve "
                         "without authentication")
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    _validate_parallel(args)
    _validate_speculative(args)
    _validate_lora(args)
    # Accepted by SGLang, not (yet) implemented here: refused, never silently ignored.
    if args.speculative_draft_model_revision is not None:
        raise ValueError(f"--speculative-draft-model-revision "
                         f"{args.speculative_draft_model_revision}: the draft model loads from "
                         "a local path (--speculative-draft-model-path), so there is no "
                         "revision to choose; drop the flag")
    if args.revision is not None:
        raise ValueError(f"--revision {args.revision}: models load from a local path here, so "
                         "there is no revision to choose; drop the flag")


def serving_defaults(args: ServerArgs, device_type: str | None = None) -> ServerArgs:
    """`core serve`'s defaults where they differ from the offline Engine's: the prefill budget
    is on (streams want a bounded inter-token latency; an offline batch wants throughput, as
    vLLM's server and its LLM class default --max-num-batched-tokens differently), on
    accelerators: on a CPU (device_type "cpu") a decode step alone takes tens of ms, so the
    budget would only hold prompts at its floor while others decode (not measured there yet:
    it stays off unless asked for)."""
    chunking = args.chunked_prefill_size is None or args.chunked_prefill_size > 0
    if args.decode_itl_target_ms is None and chunking and device_type != "cpu":
        return args.replace(decode_itl_target_ms=SERVE_ITL_TARGET_MS)
    return args


def _validate_itl_target(args: ServerArgs) -> None:
    """--decode-itl-target-ms: a time in ms, 0 for off; it cuts chunks, so it needs them."""
    t = args.decode_itl_target_ms
    if t is None:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 60_000:
        raise ValueError(f"--decode-itl-target-ms must be a number of milliseconds in "
                         f"[0, 60000] (0 turns the prefill budget off), got {t!r}")
    if t > 0 and args.chunked_prefill_size is not None and args.chunked_prefill_size < 0:
        raise ValueError(f"--decode-itl-target-ms {t:g} cuts prefill chunks, but chunked "
                         "prefill is off (--chunked-prefill-size -1); drop one of the two")


def _validate_speculative(args: ServerArgs) -> None:
    """The speculative flags' own ranges; which proposer and what it allows is the
    resolver's check (core.plan.resolver)."""
    draft_only = ("speculative_draft_load_format", "speculative_draft_model_quantization",
                  "speculative_draft_attention_backend")
    spec_only = ("speculative_num_draft_tokens", "speculative_draft_model_path", *draft_only,
                 "speculative_governor", "speculative_disable_by_batch_size")
    if args.speculative_algorithm is None:
        given = [n for n in spec_only if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")
        return
    if not args.speculative_algorithm.strip():
        raise ValueError("--speculative-algorithm is empty")
    n = args.speculative_num_draft_tokens
    if n is not None and not 1 <= n <= 64:
        raise ValueError(f"--speculative-num-draft-tokens must be in 1..64, got {n}")
    d = args.speculative_disable_by_batch_size
    if d is not None and d < 1:
        raise ValueError(f"--speculative-disable-by-batch-size must be >= 1, got {d}")
    if args.speculative_draft_model_path is None:
        given = [n for n in draft_only if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs "
                             "--speculative-draft-model-path")
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ValueError(f"--speculative-ngram-min-match-window-size {lo} and "
                         f"--speculative-ngram-max-match-window-size {hi}: need 1 <= min <= max")


LORA_ONLY = ("max_lora_rank", "lora_target_modules")


def lora_enabled(args: ServerArgs) -> bool:
    """LoRA is on: --enable-lora, or adapters named at start (SGLang's --lora-paths implies
    it)."""
    return bool(args.enable_lora or args.lora_paths or args.lora_modules)


def _validate_lora(args: ServerArgs) -> None:
    """The LoRA flags' own ranges; the adapters, the model and the backend are checked by the
    resolver and at load (core.engine.lora)."""
    if not lora_enabled(args):
        given = [n for n in LORA_ONLY if getattr(args, n) is not None]
        if args.lora_backend != "auto":
            given.append("lora_backend")
        if args.max_loras_per_batch != 8:
            given.append("max_loras_per_batch")
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} has no effect with LoRA off: add "
                             "--enable-lora (or --lora-paths NAME=PATH)")
        return
    if args.max_loras_per_batch < 1:
        raise ValueError(f"--max-loras-per-batch must be >= 1, got {args.max_loras_per_batch}")
    if args.max_lora_rank is not None and not 1 <= args.max_lora_rank <= 1024:
        raise ValueError(f"--max-lora-rank must be in 1..1024, got {args.max_lora_rank}")
    for name in LIST_FIELDS:
        value = getattr(args, name)
        if value is not None and (not isinstance(value, tuple) or not value or
                                  not all(isinstance(v, str) and v.strip() for v in value)):
            raise ValueError(f"--{name.replace('_', '-')} needs one or more non-empty values")


def _validate_parallel(args: ServerArgs) -> None:
    """The parallel flags' own consistency; what the model allows is the resolver's check."""
    if args.ep_size not in (1, args.tp_size):
        raise ValueError(f"--ep-size {args.ep_size}: expert parallelism runs over the tensor-"
                         f"parallel ranks, so it is 1 or equal to --tp-size ({args.tp_size})")
    if args.nnodes > 1:
        if args.tp_size % args.nnodes:
            raise ValueError(f"--tp-size {args.tp_size} does not split over --nnodes "
                             f"{args.nnodes} (each node runs tp-size / nnodes ranks)")
        if args.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address, "
                             "which every node can reach)")
        if args.dp_size != 1:
            raise ValueError("--dp-size with --nnodes > 1 is not supported: run one server "
                             "per data-parallel replica")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} "
                         f"(--nnodes {args.nnodes})")
    if args.dist_init_addr is not None:
        host, sep, port = args.dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr {args.dist_init_addr!r}: expected host:port")
        if args.dp_size != 1:
            raise ValueError("--dist-init-addr names one rendezvous; with --dp-size each "
                             "replica picks its own loopback port, so leave it out")
