"""The resolver: (model spec, device, user request, registry) -> Plan, with every choice explained.

A pure function: it reads capability declarations and the given DeviceInfo, allocates nothing and
probes nothing. For every slot it checks every registered candidate (core.plan.checks), ranks those that
fit by the user's choice, then the plugin's priority for the device target, then name (core.plan.slots),
and records the whole table in the plan. Requirements that shape memory (page size, KV-cache dtype, graph
capture) are settled here, before a KV pool exists: a value the user left open is adopted from
what the chosen backends need and noted; a value the user set that a backend cannot honour is an
error listing the reasons and what would fit. Nothing is swapped silently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from core.contract.capabilities import KV_CACHE_DTYPES, AttentionCaps, DeviceInfo, PageSizes
from core.contract.tools import TOOL_PARSER_OFF, template_reads_tools
from core.plan.args import ServerArgs
from core.plan.checks import (
    check_attention,
    check_grammar,
    check_layer_ops,
    check_lora,
    check_model,
    check_moe,
    check_quant,
    check_spec,
    missing_packages,
)
from core.plan.model_spec import ModelSpec
from core.plan.parser_names import parser_arg
from core.plan.plan import Candidate, Plan, ResolveError
from core.plan.quant_scheme import QuantScheme, parse_quant_config
from core.plan.reasoning import reasoning_parser_arg
from core.plan.registry import Registry
from core.plan.slots import SLOT_LABELS, Slot, merge_errors

DTYPE_NAMES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
               "float": "float32", "float32": "float32"}
KV_ALIASES = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp4_e2m1": "fp4_e2m1",
              "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
              "float16": "float16", "fp32": "float32", "float": "float32", "float32": "float32"}


def common_page_size(sizes: Sequence[PageSizes]) -> int | None:
    """The smallest page size every one of `sizes` accepts (None when they share none)."""
    multiples = [p.values[0] for p in sizes if p.mode == "multiple"]
    tries = {1, *(v for p in sizes if p.mode == "set" for v in p.values)}
    if multiples:
        tries.add(math.lcm(*multiples))
    for size in sorted(tries):
        if all(p.accepts(size) for p in sizes):
            return size
    return None


def _compute_dtype(spec: ModelSpec, device: DeviceInfo, args: ServerArgs,
                   notes: list[str]) -> str:
    asked = DTYPE_NAMES.get(args.dtype)
    config = spec.dtype
    if args.dtype != "auto" and asked is None:
        raise ResolveError(f"unknown --dtype {args.dtype!r}",
                           [f"accepted: auto, {', '.join(DTYPE_NAMES)}"])
    if asked == "bfloat16" and not device.has("bf16"):
        if device.device_type != "cpu":
            raise ResolveError(f"--dtype bfloat16: {device.name or device.target} has no bf16 "
                               f"support", [f"device features: {_features(device)}"])
        notes.append("compute dtype bfloat16 on a CPU without native bf16 (avx512_bf16/amx_bf16):"
                     " torch emulates it, slowly")
    if asked is not None:
        return asked
    if device.device_type == "cpu":
        if device.has("amx_bf16") and args.speculative_algorithm is not None:
            notes.append("compute dtype float32: the CPU default for --dtype auto with "
                         "speculative decoding, which this CPU's bf16 default would otherwise "
                         "be (AMX tiles): in bf16 the verify step (prefill attention over the "
                         "drafts) rounds differently from a decode step, so greedy answers "
                         "could change with speculation; --dtype bfloat16 to choose bf16")
            return "float32"
        if device.has("amx_bf16"):
            # SGLang's and vLLM's CPU paths compute in bf16 by default; on AMX tiles it is
            # several times fp32's rate for prefill-sized products (bench/RESULTS.md, gguf_amx).
            notes.append(f"compute dtype bfloat16: the --dtype auto default on a CPU with AMX "
                         f"bf16 tiles (config says {config or 'nothing'}; prefill-sized products "
                         f"run on the tiles; --dtype float32 computes in fp32)")
            return "bfloat16"
        notes.append(f"compute dtype float32: the CPU default for --dtype auto (config says "
                     f"{config or 'nothing'}; pass --dtype bfloat16 to use bf16)")
        return "float32"
    if config == "bfloat16" and not device.has("bf16"):
        notes.append(f"compute dtype float16: config says bfloat16 but {_where(device)} has "
                     f"no bf16")
        return "float16"
    if config in (None, "float32"):
        pick = "bfloat16" if device.has("bf16") else "float16"
        notes.append(f"compute dtype {pick}: config says {config or 'nothing'}; half precision "
                     f"is the --dtype auto default on {device.target}")
        return pick
    notes.append(f"compute dtype {config} (from the model config)")
    return config


def _features(device: DeviceInfo) -> str:
    return ",".join(sorted(device.features)) or "none"


def _kv_cache_dtype(args: ServerArgs, dtype: str, notes: list[str]) -> str:
    raw = (args.kv_cache_dtype or "auto").strip().lower()
    if raw == "auto":
        notes.append(f"KV cache dtype {dtype}: the compute dtype (--kv-cache-dtype auto)")
        return dtype
    kv = KV_ALIASES.get(raw)
    if kv is None or kv not in KV_CACHE_DTYPES:
        raise ResolveError(f"unknown --kv-cache-dtype {args.kv_cache_dtype!r}",
                           [f"accepted: auto, {', '.join(KV_ALIASES)}"])
    return kv


# Checkpoints whose weights reach the model dense (GGUF is dequantized by the loader), which an
# online method may quantize again at load.
DEQUANTIZED_AT_LOAD = ("none", "gguf")


def _fits(slot: Slot) -> bool:
    try:
        slot.options()
    except ResolveError:
        return False
    return True


def _quant_slot(spec: ModelSpec, device: DeviceInfo, args: ServerArgs, registry: Registry,
                dtype: str, slots: list[Slot], notes: list[str]) -> tuple[str, QuantScheme]:
    """The quant method: the checkpoint decides what must be loaded; the user may pick how, or
    ask for a dense checkpoint to be quantized at load (a method with an online format)."""
    ckpt = spec.quant_method or "none"
    try:
        scheme = parse_quant_config(spec.quantization)
    except ValueError as exc:
        raise ResolveError(f"cannot serve this checkpoint's quantization: {exc}") from exc
    regs = registry.kind("quant")
    user, pick = args.quantization, None
    loaders = sorted(n for n, r in regs.items() if ckpt in r.caps.config_names)
    if user is not None:
        conflict = None
        if user in regs:
            pick = user
            caps = regs[user].caps
            if ckpt in DEQUANTIZED_AT_LOAD and caps.online_format:
                errors = caps.declaration_errors()
                if errors:  # the plugin's mistake, said as such (not a traceback)
                    raise ResolveError(
                        f"--quantization {user} cannot quantize the checkpoint at load: its "
                        f"QuantCaps ({regs[user].origin.describe()}) do not hold together",
                        errors)
                scheme = caps.online_scheme()
                what = "dense checkpoint" if ckpt == "none" else f"{ckpt} weights, dequantized,"
                notes.append(f"quantization: {user} quantizes the {what} at load "
                             f"({scheme.describe()})")
            elif ckpt != "none" and ckpt not in caps.config_names:
                conflict = f"{user} loads {', '.join(sorted(caps.config_names))}"
        elif user != ckpt:
            if not any(user in r.caps.config_names for r in regs.values()):
                failed = [f"plugin {f.origin.describe()} failed to load ({f.stage}): {f.error}"
                          for f in registry.failures]
                raise ResolveError(
                    f"unknown quant method {user!r} (--quantization)",
                    [f"registered quant methods: {', '.join(sorted(regs)) or 'none'}",
                     *failed])
            conflict = f"the checkpoint's weights are stored as {ckpt}"
        if conflict:
            what = ("it is not quantized" if ckpt == "none" else
                    f"its quantization_config says quant_method={ckpt}")
            raise ResolveError(f"--quantization {user} conflicts with the checkpoint: {what}",
                               [conflict], loaders)
    slot = Slot("quant_method", "quant", registry, device.target,
                 lambda caps, _: check_quant(caps, spec, device, dtype=dtype, requested=ckpt,
                                             scheme=scheme, tp_size=args.tp_size),
                 pick, "--quantization")
    slots.append(slot)
    if pick is None and not slot.ranked():
        if loaders:
            msg = (f"no quant method that loads {ckpt} checkpoints fits {_where(device)} "
                   f"(weights: {scheme.describe()})")
        else:
            loads = sorted({c for r in regs.values() for c in r.caps.config_names})
            msg = (f"no quant method loads {ckpt} checkpoints (registered methods load: "
                   f"{', '.join(loads) or 'nothing'})")
        # the reasons of the methods that load this format first: they came closest
        fmt = [n for n in loaders if scheme.format in (regs[n].caps.formats or {scheme.format})]
        raise ResolveError(msg, slot.all_reasons(first=fmt or loaders))
    return slot.options()[0].name, scheme


def _attention(spec: ModelSpec, device: DeviceInfo, args: ServerArgs, registry: Registry,
               dtype: str, kv: str | None, notes: list[str], slots: list[Slot]
               ) -> tuple[str, str, int]:
    """Both attention phases and the page size they agree on."""
    page = args.page_size
    options, errors = [], []
    for phase in ("prefill", "decode"):
        own = getattr(args, f"{phase}_attention_backend")
        user = own if own is not None else args.attention_backend
        flag = f"--{phase}-attention-backend" if own is not None else "--attention-backend"

        def check(caps: AttentionCaps, _name: str = "", phase: str = phase,
                  page: int | None = page
                  ) -> list[str]:
            return check_attention(caps, spec, device, phase=phase, dtype=dtype,
                                   kv_cache_dtype=kv, page_size=page, cuda_graph=None)

        slot = Slot(f"{phase}_attention", "attention", registry, device.target, check, user,
                     flag)
        slots.append(slot)
        try:
            options.append(slot.options())
        except ResolveError as exc:
            if user is not None:
                errors.append(exc)
                continue
            # the backends of the model's attention kind first (an MLA model's reasons start
            # with the MLA backends', not with "MLA models need an MLA backend")
            kind = [n for n in slot.names
                    if spec.attention_kind in registry.kind("attention")[n].caps.attention_kinds]
            errors.append(ResolveError(f"no {phase} attention backend fits {spec.architecture} "
                                       f"on {_where(device)}", slot.all_reasons(first=kind)))
            continue
        if page is not None and user is None:
            # Say when the user's page size ruled out the backend that would otherwise win.
            free = Slot(slot.slot, "attention", registry, device.target,
                         lambda caps, _, phase=phase: check(caps, phase=phase, page=None), None,
                         flag).ranked()
            if free and free[0].name != options[-1][0].name:
                why = "; ".join(r for r in slot.get(free[0].name).reasons if "page size" in r)
                notes.append(f"{phase} attention {options[-1][0].name} chosen over "
                             f"{free[0].name} because of --page-size {page} ({why})")
    if errors:
        raise merge_errors(errors)
    if page is not None:
        return options[0][0].name, options[1][0].name, page
    caps = {n: r.caps for n, r in registry.kind("attention").items()}
    # Page size left open: the best pair (by rank sum, decode first) that shares a page size.
    pairs = sorted(((i, j) for i in range(len(options[0])) for j in range(len(options[1]))),
                   key=lambda ij: (ij[0] + ij[1], ij[1]))
    for i, j in pairs:
        pre, dec = options[0][i].name, options[1][j].name
        size = common_page_size([caps[pre].page_sizes, caps[dec].page_sizes])
        if size is None:
            continue
        if (i, j) != (0, 0):
            notes.append(f"attention {options[0][0].name} (prefill) and {options[1][0].name} "
                         f"(decode) share no page size: using {pre} + {dec}")
        need = sorted({n for n in (pre, dec) if not caps[n].page_sizes.accepts(1)})
        if need:
            notes.append(f"page size {size} adopted: required by {', '.join(need)}")
        else:
            notes.append("page size 1 adopted: every chosen attention backend accepts any size")
        return pre, dec, size
    pre, dec = options[0][0].name, options[1][0].name
    raise ResolveError("the prefill and decode attention backends share no page size",
                       [f"{n}: needs page size {caps[n].page_sizes.describe()}"
                        for n in (pre, dec)])


GRAMMAR_OFF = "none"


def _grammar_slot(device: DeviceInfo, args: ServerArgs, registry: Registry, slots: list[Slot],
                  notes: list[str]) -> str | None:
    """The grammar backend: the user's pick (an error when it does not fit), the best that fits
    under auto (none fitting turns structured output off, with the reasons noted: a server
    without a grammar library still serves, and refuses constrained requests), or none."""
    raw = (args.grammar_backend or "auto").strip()
    jump = args.enable_jump_forward
    if raw == GRAMMAR_OFF:
        if jump:
            raise ResolveError("--enable-jump-forward needs structured output, which "
                               "--grammar-backend none turns off")
        notes.append("structured output off: --grammar-backend none")
        return None
    user = None if raw == "auto" else raw
    slot = Slot("grammar_backend", "grammar", registry, device.target,
                lambda caps, _: check_grammar(caps, device, jump_forward=jump), user,
                "--grammar-backend")
    slots.append(slot)
    if user is not None:
        name = slot.options()[0].name
    else:
        ranked = slot.ranked()
        if not ranked:
            why = "; ".join(slot.all_reasons())
            if jump:  # asked for: never dropped with structured output as a side effect
                raise ResolveError("--enable-jump-forward: no grammar backend that can jump "
                                   "forward fits", slot.all_reasons())
            notes.append(f"structured output off: no grammar backend fits ({why})")
            return None
        name = ranked[0].name
        notes.append(f"grammar backend {name} (--grammar-backend auto)")
    if jump:
        notes.append(f"jump-forward on: forced tokens of {name}'s grammars are computed in "
                     f"one extend (--enable-jump-forward)")
    return name


# Names SGLang and vLLM give algorithms this engine has no proposer for yet (refused as such,
# unless a plugin registers one under that name)
SPEC_NOT_YET = {"eagle": "EAGLE", "eagle3": "EAGLE-3",
                "nextn": "NEXTN (multi-token prediction)", "mtp": "MTP", "medusa": "Medusa",
                "mlp_speculator": "MLP speculator", "deepseek_mtp": "DeepSeek MTP"}
DEFAULT_DRAFT_TOKENS = 4


def spec_named(registry: Registry, name: str) -> str | None:
    """The registered proposer `name` stands for: its name or an alias, case-insensitively."""
    want = name.strip().lower()
    for reg_name, reg in registry.kind("spec").items():
        if want == reg_name.lower() or want in {a.lower() for a in reg.caps.aliases}:
            return reg_name
    return None


def _spec_slot(device: DeviceInfo, args: ServerArgs, registry: Registry, slots: list[Slot],
               grammar: str | None, notes: list[str]) -> tuple[str | None, int, bool]:
    """The speculative proposer --speculative-algorithm names (None: speculation off), the
    drafts per step and whether the governor runs; an unknown name, one not built yet, or one
    that does not fit is refused."""
    raw = args.speculative_algorithm
    if raw is None:
        return None, 0, False
    name = spec_named(registry, raw)
    regs = registry.kind("spec")
    if name is None:
        key = raw.strip().lower()
        if key in SPEC_NOT_YET:
            raise ResolveError(f"--speculative-algorithm {raw}: {SPEC_NOT_YET[key]} is not "
                               "implemented yet",
                               [f"registered speculative proposers: {', '.join(sorted(regs))}"
                                " (or a plugin's, core_register_spec_proposers)"],
                               sorted(regs))
    n = args.speculative_num_draft_tokens
    slot = Slot("spec_proposer", "spec", registry, device.target,
                lambda caps, _: check_spec(caps, device, num_draft_tokens=n,
                                           tp_size=args.tp_size,
                                           draft_model=args.speculative_draft_model_path),
                name if name is not None else raw, "--speculative-algorithm")
    slots.append(slot)
    chosen = slot.options()[0].name
    caps = registry.get("spec", chosen).caps
    if n is None:
        n = min(DEFAULT_DRAFT_TOKENS, caps.max_draft_tokens)
        notes.append(f"speculative decoding: {chosen}, up to {n} draft tokens per request and "
                     "step (--speculative-num-draft-tokens left open)")
    else:
        notes.append(f"speculative decoding: {chosen}, up to {n} draft tokens per request and "
                     "step")
    governor = spec_governor_on(args, device)
    gov = ("on: each request's drafts cut per step to what its acceptance and the measured cost "
           "of a drafted token say pays" if governor else
           "off: every request asks for the full number each step (--speculative-governor on "
           "cuts drafts that do not pay)")
    if args.speculative_governor is None:
        gov += (" (--speculative-governor left open: on for a CPU, where it never lost to full "
                "drafts in bench/bench_spec_cpu.py and held open-ended prompts at 0.97-0.98x of "
                "speculation off against 0.65-0.79x; off on an accelerator until a benchmark "
                "there shows the same)")
    if args.speculative_disable_by_batch_size is not None:
        gov += (f"; no drafts in a step with more than {args.speculative_disable_by_batch_size} "
                "running requests")
    notes.append(f"speculation governor {gov}")
    if device.device_type == "cpu" and not (device.has("avx512_vnni") or device.has("amx_int8")):
        # bench/RESULTS.md, "AVX2: GGUF products of 2+ rows" (session 22)
        notes.append("speculative decoding on a CPU without AVX-512 VNNI or AMX: a verify step "
                     "of 4 drafts measured 3.3 plain decode steps on the default GGUF model, and "
                     "ngram 0.89x of speculation off on input-grounded prompts; it pays only "
                     "at high acceptance (--speculative-governor on cuts drafts that do not "
                     "pay)")
    if caps.needs_draft_weights:
        notes.append(f"{chosen}: the draft model runs eagerly (no graphs), with a KV pool of its "
                     "own sized like the target's (the memory budget is split between them)")
    if grammar is not None and not caps.grammars:
        notes.append(f"requests with a grammar constraint decode without speculation: {chosen} "
                     "cannot check drafts against a grammar (counted as spec_skipped_grammar)")
    return chosen, n, governor


def spec_governor_on(args: ServerArgs, device: DeviceInfo) -> bool:
    """Whether the speculation governor runs: --speculative-governor, else on for a CPU only
    (bench/RESULTS.md, "The speculation governor on the CPU")."""
    if args.speculative_governor is not None:
        return args.speculative_governor == "on"
    return device.device_type == "cpu"


def draft_server_args(args: ServerArgs, dtype: str, page_size: int) -> ServerArgs:
    """The arguments the draft model of a draft-model proposer is planned and loaded with:
    its path, load format, quantization and attention backend (else the target's); the
    target's compute dtype, page size, device and other kernel choices; speculation, LoRA, grammars, graphs and parallelism off (the draft is one
    model on the target's device, run eagerly)."""
    attention = {}
    if args.speculative_draft_attention_backend is not None:
        attention = {"attention_backend": args.speculative_draft_attention_backend,
                     "prefill_attention_backend": None, "decode_attention_backend": None}
    return args.replace(
        **attention, model_path=args.speculative_draft_model_path, tokenizer_path=None,
        load_format=args.speculative_draft_load_format or "auto",
        quantization=args.speculative_draft_model_quantization, dtype=dtype,
        page_size=page_size, context_length=None, speculative_algorithm=None,
        speculative_num_draft_tokens=None, speculative_config=None,
        speculative_draft_model_path=None, speculative_draft_load_format=None,
        speculative_draft_model_quantization=None, speculative_draft_attention_backend=None,
        enable_lora=False, lora_paths=None,
        lora_modules=None, lora_target_modules=None, max_lora_rank=None,
        grammar_backend="none", disable_cuda_graph=True, tp_size=1, dp_size=1, ep_size=1,
        nnodes=1, node_rank=0, reasoning_parser="none", tool_call_parser="none")


def _draft_plan(spec: ModelSpec, device: DeviceInfo, args: ServerArgs, registry: Registry,
                dtype: str, page_size: int, k: int, notes: list[str]) -> Plan:
    """The draft model's own plan (resolved like the target's, with draft_server_args); its
    vocabulary must be the target's. A draft that cannot run is refused with its reasons."""
    from core.plan.model_spec import load_model_spec

    path = args.speculative_draft_model_path
    try:
        dspec = load_model_spec(path)
    except (OSError, ValueError) as exc:
        raise ResolveError(f"--speculative-draft-model-path {path}: {exc}") from None
    if int(dspec.vocab_size) != int(spec.vocab_size):
        raise ResolveError(
            f"--speculative-draft-model-path {path}: the draft's vocabulary has "
            f"{dspec.vocab_size} ids, the target's {spec.vocab_size}",
            ["a draft model must share the target's tokenizer (the same token ids); the "
             "tokenizers themselves are compared when the engine loads them"])
    dargs = draft_server_args(args, dtype, page_size)
    try:
        draft = resolve(dspec, device, dargs, registry)
    except ResolveError as exc:
        raise ResolveError(f"the draft model {path} ({dspec.architecture}) cannot run here: "
                           f"{exc.args[0]}", exc.reasons, exc.would_fit) from None
    quant = draft.quant_method + ("" if draft.quant_format == "dense"
                                  else f" ({draft.quant_format})")
    notes.append(f"draft model {path}: {dspec.architecture}, {dspec.num_layers} layers, hidden "
                 f"{dspec.hidden_size}; dtype {draft.dtype}, quant {quant}, attention "
                 f"{draft.prefill_attention}/{draft.decode_attention}, model "
                 f"{draft.model_impl}; {k} drafts greedily per request and step")
    return draft


def _lora_slot(device: DeviceInfo, args: ServerArgs, registry: Registry, slots: list[Slot],
               dtype: str, quant: str | None, model_impl: str | None, notes: list[str]
               ) -> tuple[str | None, tuple[str, ...]]:
    """The LoRA backend (None: LoRA off) and the target modules asked for; refused when the
    model implementation takes no adapters, a target module is not one of its projections,
    or no backend fits (the base's quant method, the rank, the device)."""
    from core.plan.lora import adapter_specs, lora_enabled, target_modules_arg

    if not lora_enabled(args):
        return None, ()
    try:
        specs = adapter_specs(args)
    except ValueError as exc:
        raise ResolveError(str(exc)) from None
    supported: frozenset[str] = frozenset()
    if model_impl is not None:
        supported = registry.get("models", model_impl).caps.lora_modules
        if not supported:
            raise ResolveError(f"LoRA adapters (--enable-lora): model implementation "
                               f"{model_impl} takes no adapters",
                               ["adapters are served on the dense Llama-family models "
                                "(llama, mistral, qwen2, qwen3) in this release"])
    try:
        targets = target_modules_arg(args, supported)
    except ValueError as exc:
        raise ResolveError(str(exc)) from None
    user = None if args.lora_backend in (None, "auto") else args.lora_backend
    slot = Slot("lora_backend", "lora", registry, device.target,
                lambda caps, _: check_lora(caps, device, dtype=dtype, quant_method=quant,
                                           max_rank=args.max_lora_rank, tp_size=args.tp_size),
                user, "--lora-backend")
    slots.append(slot)
    chosen = slot.options()[0].name
    rank = (f"rank up to {args.max_lora_rank}" if args.max_lora_rank is not None else
            "rank up to the largest of the adapters loaded at start")
    where = (", ".join(sorted(targets)) if targets is not None else
             "the projections the adapters loaded at start target")
    notes.append(f"LoRA: {chosen}, {args.max_loras_per_batch} adapter slot(s) on the device, "
                 f"{rank}, on {where}; {len(specs)} adapter(s) named at start"
                 + ("" if args.enable_lora else " (--lora-paths implies --enable-lora)"))
    return chosen, tuple(sorted(targets)) if targets is not None else ()


def _tool_parser_arg(args: ServerArgs, registry: Registry) -> str | None:
    """--tool-call-parser as a registered name (None for auto / none); an unknown name is an
    error before anything starts (the template-dependent choice comes later)."""
    return parser_arg(registry, "tool_parser", (args.tool_call_parser or "auto").strip(),
                      TOOL_PARSER_OFF, "--tool-call-parser", "tool-call parser")


def resolve_tool_parser(plan: Plan, chat_template: str | None, args: ServerArgs,
                        registry: Registry) -> Plan:
    """The plan with its tool-call parser, chosen from the chat template's text (a pure
    function of it: called once the tokenizer is loaded, since a GGUF holds its template).

    auto: the best-priority parser whose markers the template holds; a template with no
    registered parser's markup (SmolLM2's) gets the best-priority parser that can offer tools
    in a system message (hermes among the built-ins). A named parser is honoured (a note says
    when the template shows none of its markers). none: auto tool calls off (tool_choice
    required and named still work: they are constrained by the grammar, not parsed). Every
    candidate goes into the table with its reasons; the notes say what was chosen and why."""
    raw = (args.tool_call_parser or "auto").strip()
    notes: list[str] = []
    template = chat_template or ""
    regs = registry.kind("tool_parser")
    if raw == TOOL_PARSER_OFF:
        notes.append("auto tool calls off: --tool-call-parser none (tool_choice required or "
                     "a named function still works: the grammar constrains the call)")
        off = tuple(Candidate(slot="tool_call_parser", name=n, origin=regs[n].origin.describe(),
                              fits=False, reasons=("--tool-call-parser none",),
                              priority=regs[n].caps.priority) for n in sorted(regs))
        return dataclasses.replace(plan, tool_call_parser=None, notes=plan.notes + tuple(notes),
                                   candidates=plan.candidates + off)
    user = _tool_parser_arg(args, registry)
    found = {n: [m for m in r.caps.markers if m in template] for n, r in regs.items()}
    any_markup = any(found.values())
    reasons: dict[str, list[str]] = {}
    for name, reg in regs.items():
        why = [f"package {m} is not installed" for m in missing_packages(reg.caps.requires)]
        if user is None and not found[name]:
            shown = ", ".join(reg.caps.markers) or "none declared"
            if any_markup:
                why.append(f"the chat template holds none of its markers ({shown})")
            elif not reg.caps.prompts:
                why.append(f"the chat template holds none of its markers ({shown}) and it "
                           "cannot offer tools in a system message")
        reasons[name] = why
    fits = sorted((n for n in regs if not reasons[n]),
                  key=lambda n: (n != user, -regs[n].caps.priority, n))
    chosen = fits[0] if fits else None
    if user is not None:
        if reasons[user]:
            raise ResolveError(f"tool-call parser {user!r} (--tool-call-parser) does not fit",
                               reasons[user], fits)
        chosen = user
        if not found[user]:
            notes.append(f"tool-call parser {user} (--tool-call-parser): the chat template "
                         f"shows none of its markers ({', '.join(regs[user].caps.markers)}); "
                         "the model may not write its format")
        else:
            notes.append(f"tool-call parser {user} (--tool-call-parser)")
    elif chosen is None:
        notes.append("auto tool calls off: no tool-call parser fits (" +
                     "; ".join(f"{n}: {r}" for n, rs in reasons.items() for r in rs) + ")")
    elif found[chosen]:
        notes.append(f"tool-call parser {chosen}: the chat template holds its markup "
                     f"({', '.join(found[chosen])}) (--tool-call-parser auto)")
    else:
        notes.append(f"tool-call parser {chosen}: the chat template holds no registered "
                     f"parser's tool markup; {chosen} is the best-priority parser that offers "
                     "tools in a system message (--tool-call-parser auto)")
    if chosen is not None and not template_reads_tools(template):
        notes.append(f"the chat template never reads `tools`: a request's tools are offered in "
                     f"a system message written by {chosen}, and tool calls / results in the "
                     f"conversation are replayed in its format (core.server.tools)")
    cands = tuple(Candidate(slot="tool_call_parser", name=n, origin=regs[n].origin.describe(),
                            fits=not reasons[n], reasons=tuple(reasons[n]),
                            priority=regs[n].caps.priority, chosen=n == chosen)
                  for n in sorted(regs))
    return dataclasses.replace(plan, tool_call_parser=chosen, notes=plan.notes + tuple(notes),
                               candidates=plan.candidates + cands)


def _where(device: DeviceInfo) -> str:
    return f"{device.target} {device.arch or ''}".strip()


def resolve(spec: ModelSpec, device: DeviceInfo, args: ServerArgs, registry: Registry) -> Plan:
    """Choose a backend for every slot; raise ResolveError listing every reason when none fits."""
    if not device.available:
        raise ResolveError(f"device {device.target} is not available", [device.reason])
    notes: list[str] = []
    dtype = _compute_dtype(spec, device, args, notes)
    kv = _kv_cache_dtype(args, dtype, notes)
    errors: list[ResolveError] = []
    slots: list[Slot] = []

    quant, scheme = None, QuantScheme()
    try:
        quant, scheme = _quant_slot(spec, device, args, registry, dtype, slots, notes)
    except ResolveError as exc:
        errors.append(exc)

    prefill = decode = None
    page = args.page_size or 1
    try:
        prefill, decode, page = _attention(spec, device, args, registry, dtype, kv, notes, slots)
    except ResolveError as exc:
        errors.append(exc)

    moe = None
    if spec.is_moe:
        user = None if args.moe_runner_backend in (None, "auto") else args.moe_runner_backend

        def moe_slot(q: str | None) -> Slot:
            q_reg = registry.get("quant", q) if q else None
            return Slot("moe_runner", "moe", registry, device.target,
                        lambda caps, name: check_moe(caps, spec, device, dtype=dtype,
                                                     quant_method=q, runner=name,
                                                     quant_caps=q_reg.caps if q_reg else None,
                                                     ep_size=args.ep_size,
                                                     quant_format=scheme.format),
                        user, "--moe-runner-backend")

        mslot = moe_slot(quant)
        if quant is not None and args.quantization is None and not _fits(mslot):
            # the best quant method has no runner for this model's experts: the next fitting
            # method that has one (a plan that runs beats a higher priority that cannot)
            qslot = next(s for s in slots if s.slot == "quant_method")
            for alt in [c.name for c in qslot.ranked() if c.name != quant]:
                alt_slot = moe_slot(alt)
                if _fits(alt_slot):
                    notes.append(f"quant method {alt} chosen over {quant}: no MoE runner takes "
                                 f"{quant} for {spec.architecture} on {_where(device)}")
                    quant, mslot = alt, alt_slot
                    break
        slots.append(mslot)
        try:
            moe = mslot.options()[0].name
        except ResolveError as exc:
            if user is None:
                exc = ResolveError(f"no MoE runner fits {spec.architecture} "
                                   f"({spec.moe.num_experts} experts, top-{spec.moe.top_k})"
                                   f"{' with ' + quant if quant else ''} on {_where(device)}",
                                   exc.reasons)
            errors.append(exc)
    elif args.moe_runner_backend not in (None, "auto"):
        notes.append(f"--moe-runner-backend {args.moe_runner_backend} has no effect: "
                     f"{spec.architecture} is a dense model")

    ops = None
    oslot = Slot("layer_ops", "layer_ops", registry, device.target,
                  lambda caps, _: check_layer_ops(caps, device, dtype=dtype), args.layer_ops,
                  "--layer-ops")
    slots.append(oslot)
    try:
        ops = oslot.options()[0].name
    except ResolveError as exc:
        errors.append(exc)

    mslot = Slot("model", "models", registry, device.target,
                  lambda caps, _: check_model(caps, spec), None, "")
    slots.append(mslot)
    model_impl = mslot.ranked()[0].name if mslot.ranked() else None
    if model_impl is None:
        notes.append(f"no model implementation registered for {spec.architecture}: the engine "
                     f"cannot run it")

    grammar = None
    try:
        grammar = _grammar_slot(device, args, registry, slots, notes)
    except ResolveError as exc:
        errors.append(exc)
    try:  # the choice needs the chat template (resolve_tool_parser); a bad name fails now
        _tool_parser_arg(args, registry)
    except ResolveError as exc:
        errors.append(exc)
    try:  # the same for the reasoning parser (core.plan.reasoning)
        reasoning_parser_arg(args, registry)
    except ResolveError as exc:
        errors.append(exc)

    spec_name, spec_n, spec_governor, spec_draft = None, 0, False, None
    try:
        spec_name, spec_n, spec_governor = _spec_slot(device, args, registry, slots, grammar,
                                                      notes)
        if spec_name is not None and registry.get("spec", spec_name).caps.needs_draft_weights:
            spec_draft = _draft_plan(spec, device, args, registry, dtype, page, spec_n, notes)
    except ResolveError as exc:
        errors.append(exc)

    lora, lora_targets = None, ()
    try:
        lora, lora_targets = _lora_slot(device, args, registry, slots, dtype, quant, model_impl,
                                        notes)
    except ResolveError as exc:
        errors.append(exc)

    try:
        _parallel(spec, device, args, notes)
    except ResolveError as exc:
        errors.append(exc)

    if errors:
        raise merge_errors(errors, tuple(c for s in slots for c in s.candidates))
    assert quant is not None and prefill is not None and decode is not None and ops is not None

    cuda_graph = _graph_capture(device, args, registry, decode, moe, ops, notes, lora)
    verify_graphs = spec_name is not None and _verify_graphs(registry, decode, cuda_graph, notes)
    chosen = {"quant_method": quant, "prefill_attention": prefill, "decode_attention": decode,
              "moe_runner": moe, "layer_ops": ops, "model": model_impl,
              "grammar_backend": grammar, "spec_proposer": spec_name, "lora_backend": lora}
    candidates = tuple(dataclasses.replace(c, chosen=chosen.get(c.slot) == c.name)
                       for s in slots for c in s.candidates)
    return Plan(device=device, dtype=dtype, prefill_attention=prefill, decode_attention=decode,
                moe_runner=moe, quant_method=quant, kv_cache_dtype=kv, page_size=page,
                cuda_graph=cuda_graph, model_impl=model_impl, notes=tuple(notes),
                candidates=candidates, layer_ops=ops, quant_format=scheme.format,
                grammar_backend=grammar, spec_proposer=spec_name, spec_draft_tokens=spec_n,
                spec_draft=spec_draft, spec_verify_graphs=verify_graphs,
                spec_governor=spec_governor,
                lora_backend=lora, lora_slots=args.max_loras_per_batch if lora else 0,
                lora_max_rank=args.max_lora_rank if lora else None,
                lora_target_modules=lora_targets)


def _parallel(spec: ModelSpec, device: DeviceInfo, args: ServerArgs, notes: list[str]) -> None:
    """Whether the model splits over --tp-size ranks (heads, KV heads, MLP and expert widths;
    the vocabulary is padded), and the devices the ranks and replicas need; a refusal names
    the sizes and the --tp-size values that would work."""
    from core.engine.distributed import fitting_tp_sizes, tp_problems

    tp, ep = args.tp_size, args.ep_size
    sizes = {"intermediate_size": spec.intermediate_size or 0}
    if spec.moe is not None:
        sizes["moe_intermediate_size"] = spec.moe.intermediate_size or 0
        sizes["shared_expert_intermediate_size"] = spec.moe.shared_expert_intermediate_size or 0
        if spec.moe.moe_layers and len(spec.moe.moe_layers) == spec.num_layers:
            sizes.pop("intermediate_size")  # no dense layer: its width is never built
    if tp > 1:
        # MLA: heads split, the one latent row per token replicated on every rank (as one
        # KV head is under MQA), so only the query heads must divide
        mla = spec.attention_kind == "MLA"
        kv_heads = 1 if mla else spec.num_kv_heads
        reasons = tp_problems(spec.num_heads, kv_heads, sizes, tp,
                              spec.moe.num_experts if spec.moe else None, ep)
        if reasons:
            fits = ", ".join(map(str, fitting_tp_sizes(spec.num_heads, kv_heads, sizes)))
            heads = (f"{spec.num_heads} heads" if mla else
                     f"{spec.num_heads} heads, {spec.num_kv_heads} KV heads")
            raise ResolveError(
                f"{spec.architecture} does not split over --tp-size {tp}",
                [*reasons, f"--tp-size values (of 1..8) that split its {heads} and MLP "
                 f"widths: {fits}"])
        if mla:
            kv_note = "; the MLA latent cache replicated on every rank"
        else:
            kv_note = ("" if spec.num_kv_heads >= tp else
                       f"; {spec.num_kv_heads} KV heads replicated onto {tp} ranks")
        notes.append(f"tensor parallel over {tp} ranks: {spec.num_heads // tp} heads per rank"
                     f"{kv_note}; vocab {spec.vocab_size} in shards of "
                     f"{-(-spec.vocab_size // tp)}")
    if ep > 1 and spec.moe is None:
        raise ResolveError(f"--ep-size {ep} has no effect: {spec.architecture} has no experts",
                           ["drop --ep-size (dense models split over --tp-size only)"])
    if ep > 1:
        notes.append(f"expert parallel over {ep} ranks: {spec.moe.num_experts // ep} whole "
                     f"experts per rank, their outputs summed with the attention's all-reduce "
                     f"pattern (every rank holds every token)")
    here = tp // args.nnodes
    if device.count and device.dist_backend != "gloo":  # one accelerator per rank
        if here > device.count:
            raise ResolveError(f"--tp-size {tp} needs {here} devices per node; "
                               f"{device.describe()}", [f"this node has {device.count}"])
        if here * args.dp_size > device.count:
            notes.append(f"{args.dp_size} data-parallel replicas x {here} rank(s) on "
                         f"{device.count} device(s): replicas share devices round-robin and "
                         f"split their free memory")


def _graph_capture(device: DeviceInfo, args: ServerArgs, registry: Registry, decode: str,
                   moe: str | None, ops: str, notes: list[str], lora: str | None = None
                   ) -> bool:
    """Graphs capture the decode step only, so the decode backend and MoE runner decide."""
    if not device.graph_capture:
        notes.append(f"graph capture off: the {device.target} platform captures no decode "
                     f"graphs (its Platform.graphs())")
        return False
    if args.disable_cuda_graph:
        notes.append("graph capture off: --disable-cuda-graph")
        return False
    blockers = []
    if not registry.get("attention", decode).caps.cuda_graph:
        blockers.append(f"decode attention {decode}")
    if moe is not None and not registry.get("moe", moe).caps.cuda_graph:
        blockers.append(f"MoE runner {moe}")
    if not registry.get("layer_ops", ops).caps.cuda_graph:
        blockers.append(f"layer ops {ops}")
    if lora is not None and not registry.get("lora", lora).caps.graph_safe:
        blockers.append(f"LoRA backend {lora}")
    if blockers:
        notes.append(f"graph capture off: {' and '.join(blockers)} cannot be captured in CUDA "
                     f"graphs")
        return False
    notes.append("graph capture on: every decode-step backend supports it")
    if lora is not None:
        notes.append(f"decode graphs capture the LoRA path (LoRA backend {lora} is graph "
                     f"safe): steps serving adapters replay them, each row's adapter slot a "
                     f"graph input; steps of base requests alone replay the same graphs and pay "
                     f"the LoRA kernels' launches (every row skipped)")
    return True


def _verify_graphs(registry: Registry, decode: str, cuda_graph: bool, notes: list[str]) -> bool:
    """Whether speculative verify steps replay the decode graphs, as decode rows (one row per
    verified token: the request's last token and each draft), with a note either way."""
    if cuda_graph and registry.get("attention", decode).caps.verify_rows:
        notes.append(f"speculative verify steps replay the decode graphs as decode rows (one "
                     f"per verified token; decode attention {decode} declares verify_rows); "
                     f"a step's drafts are cut so that its rows fit the largest captured "
                     f"batch (spec_graph_cut), and a batch past the graphs verifies eagerly "
                     f"as one extend")
        return True
    why = ("no decode graphs" if not cuda_graph else
           f"decode attention {decode} does not declare verify_rows")
    notes.append(f"speculative verify steps run eagerly (one extend over each request's last "
                 f"token and its drafts; {why}); decode graphs serve the steps without drafts")
    return False


# ---------------------------------------------------------------------------------- explaining

def _candidate_rows(candidates: Sequence[Candidate]) -> list[str]:
    lines: list[str] = []
    for slot in dict.fromkeys(c.slot for c in candidates):
        lines.append(f"{SLOT_LABELS.get(slot, slot)}:")
        rows = [c for c in candidates if c.slot == slot]
        if slot == "model":
            # Every architecture is a candidate: list only those that serve this model.
            others = [c for c in rows if any(r.startswith("does not implement")
                                             for r in c.reasons)]
            rows = [c for c in rows if c not in others]
            if others:
                lines.append(f"    ({len(others)} other implementation(s) serve other "
                             f"architectures: {', '.join(c.name for c in others)})")
            if not rows:
                continue
        width = max(len(c.name) for c in rows)
        for c in sorted(rows, key=lambda c: (not c.chosen, not c.fits, -c.priority, c.name)):
            mark = "*" if c.chosen else " "
            status = "chosen" if c.chosen else ("fits" if c.fits else "no")
            head = f"  {mark} {c.name:<{width}}  {status:<6}  prio {c.priority:<4} {c.origin}"
            lines.append(head.rstrip())
            lines += [f"      - {r}" for r in c.reasons]
    return lines


def explain(plan: Plan) -> str:
    """The plan, its notes, then every candidate of every slot with fits/chosen/reasons."""
    rows = [("device", plan.device.describe()), ("compute dtype", plan.dtype),
            ("quant method", plan.quant_method
             + ("" if plan.quant_format == "dense" else f" ({plan.quant_format})")),
            ("prefill attention", plan.prefill_attention),
            ("decode attention", plan.decode_attention),
            ("MoE runner", plan.moe_runner or "- (dense model)"),
            ("layer ops", plan.layer_ops),
            ("KV cache dtype", plan.kv_cache_dtype), ("page size", str(plan.page_size)),
            ("graph capture", "on" if plan.cuda_graph else "off"),
            ("model impl", plan.model_impl or "- (none registered)"),
            ("grammar backend", plan.grammar_backend or "- (structured output off)")]
    rows.append(("speculative", f"{plan.spec_proposer}, {plan.spec_draft_tokens} draft tokens"
                 f", governor {'on' if plan.spec_governor else 'off'}"
                 if plan.spec_proposer else "- (off)"))
    if plan.spec_draft is not None:
        d = plan.spec_draft
        rows.append(("draft model", f"{d.model_impl}, {d.dtype}, {d.quant_method}, "
                     f"attention {d.prefill_attention}/{d.decode_attention}"))
    if plan.lora_backend is not None:
        rows.append(("LoRA backend", f"{plan.lora_backend}, {plan.lora_slots} slot(s)"))
    if any(c.slot == "tool_call_parser" for c in plan.candidates):  # chosen with a template
        rows.append(("tool-call parser", plan.tool_call_parser or "- (auto tool calls off)"))
    if any(c.slot == "reasoning_parser" for c in plan.candidates):  # asked for, and chosen
        rows.append(("reasoning parser", plan.reasoning_parser or "- (off)"))
    lines = ["Plan:"] + [f"  {k:<18} {v}" for k, v in rows]
    if plan.notes:
        lines += ["", "Notes:"] + [f"  - {n}" for n in plan.notes]
    if plan.candidates:
        lines += ["", "Candidates (* = chosen):"] + _candidate_rows(plan.candidates)
    return "\n".join(lines)


def error_table(err: ResolveError) -> str:
    """The error, its reasons and what would fit, then the candidate table it carries."""
    lines = [str(err)]
    if err.candidates:
        lines += ["", "Candidates:"] + _candidate_rows(err.candidates)
    return "\n".join(lines)
