"""The `core` command: list plugins, explain a plan, serve, generate.

    core backends [--json]             every discovered plugin and whether it can run here
    core resolve [--model-path P] ...  the plan for a model on a (real or simulated) device
    core matrix [--plans] [--json] ... the support matrix: every plugin's declared capabilities,
                                       the plans for representative models on every profile
    core serve [--config FILE] ...     the HTTP server (core.server)
    core generate PROMPT ...           offline generation (core.entrypoints)

Exit codes: 0 ok, 1 nothing fits / a setting conflicts, 2 usage error, 3 a plugin failed to load
under CORE_STRICT_PLUGINS=1, 4 (`core serve`) the engine worker died. Errors are one clear line
(plus the reasons), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from core.contract.capabilities import KINDS
from core.contract.hookspecs import PLUGIN_API_VERSION
from core.contract.json_types import JSON
from core.plan.args import add_cli_args, from_namespace, load_yaml_config
from core.plan.hf_imports import keep_torchvision_out
from core.plan.matrix import jsonable
from core.plan.registry import PluginError, Registry, get_registry

if TYPE_CHECKING:
    from core.plan.args import ServerArgs
    from core.plan.registry import Registration

EXIT_OK, EXIT_NO_FIT, EXIT_USAGE, EXIT_PLUGIN = 0, 1, 2, 3
# core.engine.worker.STARTUP_PROGRESS_ENV (not imported: the worker module imports torch)
STARTUP_PROGRESS_ENV = "CORE_STARTUP_PROGRESS"


class _UsageError(Exception):
    """A bad flag value, path or profile: reported in one line, exit code 2."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="core", description="A plugin-based kernel-backend framework for LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("backends", help="list every discovered plugin and its status",
                       description="List hardware targets, attention backends, MoE runners, "
                                   "quant methods and models, with where they came from and "
                                   "whether they can run here.")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("resolve", help="explain the plan for a model on a device",
                       description="Choose a backend for every slot and explain every choice "
                                   "and rejection. Use --device-profile to plan for hardware "
                                   "that is not here.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_cli_args(p, groups=("model", "kernels", "scheduling", "parallel", "speculative",
                             "lora"))
    _add_field_flag(p, "tool_call_parser")
    _add_field_flag(p, "reasoning_parser")
    _add_field_flag(p, "chat_template")

    p = sub.add_parser("matrix", help="the support matrix, generated from the declarations",
                       description="One markdown table per plugin kind: a row per registered "
                                   "plugin, its distribution and what it declares. --plans "
                                   "adds what the resolver chooses for representative models "
                                   "in each dtype and weight format on every device profile.")
    p.add_argument("--json", action="store_true",
                   help="the capability dataclasses (and plans) as JSON")
    p.add_argument("--kind", choices=KINDS, help="one kind's table only")
    p.add_argument("--plans", action="store_true",
                   help="add the resolver's plans on every device profile")
    p.add_argument("--only", metavar="DISTRIBUTION",
                   help="only this distribution's plugins (`--only core-serve`: the built-in "
                        "ones, as docs/SUPPORT.md shows them; no version column)")
    p.add_argument("--model-path", action="append", default=[], metavar="CONFIG",
                   help="with --plans: plan this model (a config.json or a folder holding "
                        "one) instead of the representative ones; repeatable")
    p.add_argument("--device-profile", action="append", default=[], metavar="PROFILE",
                   help="with --plans: plan on this profile (a name or a JSON file) instead of "
                        "every built-in one; repeatable")

    p = sub.add_parser("serve", help="run the HTTP server",
                       description="Serve a model over HTTP. Flags override --config.")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of flag: value")
    add_cli_args(p)

    p = sub.add_parser("generate", help="generate text offline",
                       description="Generate completions for the given prompts.")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text(s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 samples greedily")
    p.add_argument("--verbose", action="store_true",
                   help="print the whole plan and the engine's notes (default: one line)")
    # (no LoRA flags: a prompt here has no way to name an adapter; `core serve` and
    # core.Engine(lora_paths=...) serve them)
    add_cli_args(p, groups=("model", "kernels", "scheduling", "parallel", "speculative"))
    return parser


def _add_field_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """One ServerArgs field of a group the command does not take whole, as its --flag."""
    from core.plan.args import ServerArgs

    f = next(f for f in dataclasses.fields(ServerArgs) if f.name == name)
    parser.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                        help=f.metadata["help"])


# ------------------------------------------------------------------------------------ backends

def _backend_status(registry: Registry, kind: str, reg: Registration) -> tuple[str, str]:
    """(status, reason) of one registration: available, unavailable or failed."""
    if kind == "hardware":
        info = registry.probe(reg.name)
        failed = any(f.stage == "probe" and f.origin == reg.origin for f in registry.failures)
        if failed:
            return "failed", info.reason
        return ("available", "") if info.available else ("unavailable", info.reason)
    from core.plan.checks import missing_packages

    missing = missing_packages(getattr(reg.caps, "requires", ()))
    if missing:
        return "unavailable", "; ".join(f"package {m} is not installed" for m in missing)
    return "available", ""


class _BackendRow(TypedDict):
    kind: str
    name: str
    plugin: str
    distribution: str
    version: str
    status: str  # available | unavailable | failed
    reason: str
    summary: str
    caps: JSON


class BackendRow(_BackendRow, total=False):
    """One registration as `core backends` lists it (--json: one object of "plugins")."""

    device: str  # an available hardware target's device


def _backends_rows(registry: Registry) -> list[BackendRow]:
    rows: list[BackendRow] = []
    for kind in KINDS:
        for name, reg in sorted(registry.kind(kind).items()):
            status, reason = _backend_status(registry, kind, reg)
            row: BackendRow = {"kind": kind, "name": name, "plugin": reg.origin.plugin,
                   "distribution": reg.origin.dist, "version": reg.origin.version,
                   "status": status, "reason": reason, "summary": reg.caps.summary(),
                   "caps": jsonable(reg.caps)}
            if kind == "hardware" and status == "available":
                row["device"] = registry.probe(name).describe()
            rows.append(row)
    return rows


def _failure_rows(registry: Registry) -> list[dict[str, str]]:
    return [{"plugin": f.origin.plugin, "distribution": f.origin.dist,
             "version": f.origin.version, "stage": f.stage, "error": f.error}
            for f in registry.failures]


def _cmd_backends(ns: argparse.Namespace) -> int:
    registry = get_registry()
    rows = _backends_rows(registry)
    failures = _failure_rows(registry)  # after the probes, which may add failures
    if ns.json:
        print(json.dumps({"plugins": rows, "failures": failures,
                          "api_version": PLUGIN_API_VERSION}, indent=2))
        return EXIT_OK
    print(f"core plugin API {PLUGIN_API_VERSION}")
    for kind in KINDS:
        entries = [r for r in rows if r["kind"] == kind]
        print(f"\n{kind}:")
        if not entries:
            print("  (none registered)")
        width = max((len(r["name"]) for r in entries), default=0)
        for r in entries:
            origin = f"{r['distribution']} {r['version']}".strip()
            status = r["status"] + (f": {r['reason'] or r.get('device', '')}"
                                    if r["reason"] or r.get("device") else "")
            print(f"  {r['name']:<{width}}  {origin}  [{status}]")
            print(f"  {'':<{width}}    {r['summary']}")
    if failures:
        print("\nfailed to load:")
        for f in failures:
            origin = f"{f['distribution']} {f['version']}".strip()
            print(f"  {f['plugin']} ({origin}) at {f['stage']}: {f['error']}")
    return EXIT_OK


# ------------------------------------------------------------------------------------- resolve

def _server_args(ns: argparse.Namespace, base: dict[str, object] | None = None) -> ServerArgs:
    try:
        return from_namespace(ns, base)
    except (ValueError, TypeError) as exc:
        raise _UsageError(str(exc)) from exc


def _model_spec(path: str | None):
    from core.plan.model_spec import load_model_spec

    if path is None:
        try:
            from core.plan.default_model import default_model_path

            path = default_model_path()
        except (ImportError, OSError, ValueError, RuntimeError) as exc:
            raise _UsageError(f"no --model-path given and the default model is not available: "
                              f"{exc}") from exc
    try:
        return load_model_spec(path)
    except (OSError, ValueError, KeyError) as exc:
        raise _UsageError(f"--model-path {path}: {exc}") from exc


def chat_template_of(args: ServerArgs, path: str | None) -> tuple[str | None, str]:
    """The chat template the server would read for the model at `path` (what the tool-call
    parser is chosen by), without loading the tokenizer: (its text or None, where it came
    from). --chat-template wins; else a GGUF file's tokenizer.chat_template, else
    chat_template.jinja or tokenizer_config.json's chat_template beside the config."""
    if args.chat_template:
        if os.path.isfile(args.chat_template):
            with open(args.chat_template) as fh:
                return fh.read(), f"--chat-template {args.chat_template}"
        return args.chat_template, "--chat-template"
    if not path:
        return None, "no model path"
    if path.endswith(".gguf") and os.path.isfile(path):
        from core.plan.gguf_metadata import read_gguf_metadata

        template = read_gguf_metadata(path).fields.get("tokenizer.chat_template")
        if isinstance(template, str) and template:
            return template, "the GGUF file's tokenizer.chat_template"
        return None, "the GGUF file holds no tokenizer.chat_template"
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as fh:
            return fh.read(), jinja
    config = os.path.join(folder, "tokenizer_config.json")
    try:
        with open(config) as fh:
            template = json.load(fh).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"), None)
    if isinstance(template, str) and template:
        return template, f"{config} chat_template"
    return None, f"no chat template beside {path} (no chat_template.jinja, no chat_template in " \
                 "tokenizer_config.json)"


def _with_assumptions(text: str, unread: Sequence[str]) -> str:
    """explain()'s text with what the config did not say under its own heading, after the
    notes (values assumed, not errors)."""
    if not unread:
        return text
    block = "\n".join(["", "Assumed (the model's config does not say; not an error):",
                       *(f"  - {line}" for line in unread)])
    head, sep, tail = text.partition("\n\nCandidates (* = chosen):")
    return head + "\n" + block + sep + tail


def _cmd_resolve(ns: argparse.Namespace) -> int:
    from core.plan.devices import select_device
    from core.plan.plan import ResolveError
    from core.plan.reasoning import resolve_reasoning_parser
    from core.plan.resolver import error_table, explain, resolve, resolve_tool_parser

    args = _server_args(ns)
    spec = _model_spec(args.model_path)
    registry = get_registry()
    try:
        device = select_device(registry, device=args.device, profile=args.device_profile)
    except ValueError as exc:
        raise _UsageError(str(exc)) from exc
    try:
        plan = resolve(spec, device, args, registry)
        # the tool-call parser is chosen by the chat template, read as the server would
        template, whence = chat_template_of(args, spec.source or args.model_path)
        plan = resolve_tool_parser(plan, template, args, registry)
        plan = resolve_reasoning_parser(plan, template, args, registry)
        plan = dataclasses.replace(plan, notes=plan.notes + (
            f"chat template (for the tool-call parser): {whence}",))
        if plan.reasoning_parser is not None:
            plan = dataclasses.replace(plan, notes=plan.notes + (
                f"chat template (for the reasoning parser): {whence}",))
    except ResolveError as err:
        if ns.json:
            print(json.dumps({"error": err.args[0], "reasons": err.reasons,
                              "would_fit": err.would_fit,
                              "candidates": [dataclasses.asdict(c) for c in err.candidates]},
                             indent=2))
        else:
            print(f"model: {spec.architecture} ({spec.source or args.model_path})")
            print(f"device: {device.describe()}\n")
            print(error_table(err))
        return EXIT_NO_FIT
    if ns.json:
        print(json.dumps({"model": spec.architecture, "assumed": list(spec.unread),
                          "plan": plan.to_dict()}, indent=2, default=list))
    else:
        print(f"model: {spec.architecture} ({spec.source or args.model_path})")
        print(_with_assumptions(explain(plan), spec.unread))
    if plan.model_impl is None:
        # the plan is printed (it says which kernels would run), but nothing could serve it
        print(f"error: no model implementation serves {spec.architecture}", file=sys.stderr)
        return EXIT_NO_FIT
    return EXIT_OK


# -------------------------------------------------------------------------------------- matrix

def _cmd_matrix(ns: argparse.Namespace) -> int:
    from core.plan.matrix import document

    if not ns.plans and (ns.model_path or ns.device_profile):
        flag = "--model-path" if ns.model_path else "--device-profile"
        raise _UsageError(f"{flag} chooses what --plans plans for: add --plans")
    try:
        text = document(get_registry(), kind=ns.kind, plans=ns.plans, dist=ns.only,
                        model_paths=ns.model_path, profiles=ns.device_profile,
                        as_json=ns.json)
    except ValueError as exc:
        raise _UsageError(str(exc)) from exc
    sys.stdout.write(text)
    return EXIT_OK


# ------------------------------------------------------------------------- serve and generate

def _engine_entry(command: str, module: str, attr: str):
    """The engine's entry point, imported only now; None when this version lacks it."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (exc.name == module or module.startswith(exc.name + ".")):
            raise  # the module exists but one of its own imports is missing: a real error
        mod = None
    fn = getattr(mod, attr, None)
    if fn is None:
        print(f"core {command}: the engine is not available yet in this version",
              file=sys.stderr)
    return fn


def _cmd_serve(ns: argparse.Namespace) -> int:
    base = None
    if ns.config:
        try:
            base = load_yaml_config(ns.config)
        except OSError as exc:
            raise _UsageError(f"--config {ns.config}: {exc.strerror or exc}") from exc
        except Exception as exc:  # noqa: BLE001 - YAML syntax errors come in several types
            raise _UsageError(f"--config {ns.config}: {exc}") from exc
    args = _server_args(ns, base)
    serve_main = _engine_entry("serve", "core.server", "serve_main")
    if serve_main is None:
        return EXIT_USAGE
    # a line per start-up phase (weights, memory, KV cache, runner, scheduler) from the worker,
    # instead of silence while kernels build and the model loads; CORE_STARTUP_PROGRESS=0: none
    os.environ.setdefault(STARTUP_PROGRESS_ENV, "1")
    return int(serve_main(args) or 0)


def _cmd_generate(ns: argparse.Namespace) -> int:
    if ns.max_new_tokens < 1:
        raise _UsageError(f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}")
    if ns.temperature < 0:
        raise _UsageError(f"--temperature must be >= 0, got {ns.temperature}")
    args = _server_args(ns)
    generate_main = _engine_entry("generate", "core.entrypoints", "generate_main")
    if generate_main is None:
        return EXIT_USAGE
    if ns.verbose:
        os.environ.setdefault(STARTUP_PROGRESS_ENV, "1")
    return int(generate_main(args, ns) or 0)


COMMANDS = {"backends": _cmd_backends, "resolve": _cmd_resolve, "matrix": _cmd_matrix,
            "serve": _cmd_serve, "generate": _cmd_generate}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `core` console script; returns the exit code."""
    keep_torchvision_out()  # before anything imports transformers (core.plan.hf_imports)
    parser = _build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error
        return int(exc.code or 0)
    try:
        return COMMANDS[ns.command](ns)
    except BrokenPipeError:  # `core backends | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return EXIT_OK
    except _UsageError as exc:
        print(f"core {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PluginError as exc:
        print(f"core {ns.command}: plugin failure (CORE_STRICT_PLUGINS is set): {exc}",
              file=sys.stderr)
        return EXIT_PLUGIN


if __name__ == "__main__":
    sys.exit(main())
