"""Plugin discovery and the registry: pluggy over the `core.plugins` entry-point group.

Failure isolation: a plugin that fails to import, declares an unsupported API range, or raises
while registering is skipped and recorded (with its distribution and error). `CORE_STRICT_PLUGINS=1`
turns any such failure into an error. `CORE_PLUGINS_ALLOW` / `CORE_PLUGINS_DENY` are comma-separated
lists of entry-point names or distribution names that filter what loads.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from core.contract import hookspecs
from core.contract.capabilities import CAPS_TYPES, KINDS, Caps, DeviceInfo
from core.contract.platform import platform_problem

log = logging.getLogger("core.plugins")

HOOK_FOR_KIND = {
    "hardware": "core_register_hardware",
    "attention": "core_register_attention_backends",
    "moe": "core_register_moe_runners",
    "quant": "core_register_quant_methods",
    "models": "core_register_models",
    "layer_ops": "core_register_layer_ops",
    "grammar": "core_register_grammar_backends",
    "tool_parser": "core_register_tool_parsers",
    "spec": "core_register_spec_proposers",
    "reasoning_parser": "core_register_reasoning_parsers",
    "lora": "core_register_lora_backends",
}


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered (fatal only in strict mode)."""


@dataclass(frozen=True)
class Origin:
    """Where a plugin came from."""

    plugin: str  # entry-point name (or in-process name)
    dist: str  # distribution name, or "<in-process>"
    version: str = ""

    def describe(self) -> str:
        return f"{self.dist} {self.version}".strip() + f" ({self.plugin})"


@dataclass
class Registration:
    """One registered backend / target / model of one kind."""

    kind: str
    name: str
    caps: Caps  # its kind's: CAPS_TYPES[kind]
    factory: Callable | str
    origin: Origin
    # hardware only: the target's core.contract.platform.BasePlatform subclass (or a factory of
    # one), called with the DeviceInfo; resolved and checked when the plugin registers
    platform: Callable | None = None

    def load(self) -> Callable:
        """Resolve a lazy "module:attr" factory; this is where kernel libraries get imported."""
        return load_ref(self.factory)


def load_ref(ref: Callable | str) -> Any:  # whatever the reference names
    """The object a plugin's "module:attr" reference names (attr may be dotted); a callable is
    its own object. The one loader of lazy references."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


@dataclass
class Failure:
    """A plugin that was skipped, with the stage it failed at."""

    origin: Origin
    stage: str  # import | api | register | probe
    error: str
    detail: str = ""


@dataclass
class Registry:
    """Everything discovered: registrations by kind, failures, and hardware probe results."""

    entries: dict[str, dict[str, Registration]] = field(
        default_factory=lambda: {k: {} for k in KINDS})
    failures: list[Failure] = field(default_factory=list)
    plugins: list[Origin] = field(default_factory=list)
    _probes: dict[str, DeviceInfo] = field(default_factory=dict)

    def kind(self, kind: str) -> dict[str, Registration]:
        return self.entries[kind]

    def get(self, kind: str, name: str) -> Registration | None:
        return self.entries[kind].get(name)

    def probe(self, target: str) -> DeviceInfo:
        """Probe one hardware target once; a probe that raises is recorded, never propagated."""
        if target in self._probes:
            return self._probes[target]
        reg = self.entries["hardware"][target]
        try:
            info = reg.load()()
            if not isinstance(info, DeviceInfo):
                raise TypeError(f"probe returned {type(info).__name__}, not DeviceInfo")
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            err = f"{type(exc).__name__}: {exc}"
            self.failures.append(Failure(reg.origin, "probe", err, traceback.format_exc()))
            if strict_mode():
                raise PluginError(f"hardware probe {target!r} from {reg.origin.describe()} "
                                  f"failed: {err}") from exc
            log.warning("hardware probe %s from %s failed: %s", target, reg.origin.describe(), err)
            info = DeviceInfo(target=target, device_type=reg.caps.device_type, available=False,
                              reason=f"probe failed: {err}")
        self._probes[target] = info
        return info

    def probe_all(self) -> dict[str, DeviceInfo]:
        return {name: self.probe(name) for name in self.entries["hardware"]}


def strict_mode() -> bool:
    return os.environ.get("CORE_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _check_api(module: object) -> str | None:
    """Return a rejection reason if the plugin's declared API range excludes ours."""
    spec = getattr(module, "CORE_PLUGIN_API", None)
    if spec is None:
        return None
    try:
        ok = Version(hookspecs.PLUGIN_API_VERSION) in SpecifierSet(str(spec))
    except InvalidSpecifier as exc:
        return f"invalid CORE_PLUGIN_API {spec!r}: {exc}"
    if not ok:
        return (f"plugin supports core plugin API {spec!r}, "
                f"this core provides {hookspecs.PLUGIN_API_VERSION}")
    return None


class _Register:
    """The `register` callback handed to one plugin for one kind."""

    def __init__(self, registry: Registry, kind: str, origin: Origin):
        self.registry, self.kind, self.origin = registry, kind, origin

    def __call__(self, name: str, caps: Caps, factory: Callable | str,
                 platform: Callable | str | None = None) -> None:
        if not isinstance(name, str) or not name or not name.replace("-", "_").replace(".", "_") \
                .isidentifier():
            raise PluginError(f"invalid {self.kind} name {name!r}")
        want = CAPS_TYPES[self.kind]
        if not isinstance(caps, want):
            raise PluginError(f"{self.kind} {name!r}: caps must be {want.__name__}, "
                              f"got {type(caps).__name__}")
        if not (callable(factory) or (isinstance(factory, str) and factory.strip())):
            raise PluginError(f"{self.kind} {name!r}: factory must be callable or 'module:attr'")
        if platform is not None:
            if self.kind != "hardware":
                raise PluginError(f"{self.kind} {name!r}: only hardware targets register a "
                                  "platform")
            if not (callable(platform) or (isinstance(platform, str) and ":" in platform)):
                raise PluginError(f"hardware {name!r}: platform must be callable or "
                                  "'module:attr'")
            platform = _platform(name, platform)
        existing = self.registry.entries[self.kind].get(name)
        if existing is not None:
            raise PluginError(f"duplicate {self.kind} name {name!r}: registered by "
                              f"{existing.origin.describe()} and by {self.origin.describe()}")
        self.registry.entries[self.kind][name] = Registration(self.kind, name, caps, factory,
                                                              self.origin, platform)


def _platform(name: str, ref: Callable | str) -> Callable:
    """A hardware target's platform reference, resolved and checked now: a wrong one is refused
    when its plugin registers, not when an engine starts on it."""
    what = f"hardware {name!r}: platform" + (f" {ref!r}" if isinstance(ref, str) else "")
    try:
        obj = load_ref(ref)
    except Exception as exc:  # noqa: BLE001 - the reason names the reference
        raise PluginError(f"{what} cannot be loaded ({type(exc).__name__}: {exc})") from exc
    problem = platform_problem(obj)
    if problem is not None:
        raise PluginError(f"{what} is refused: {problem}")
    return obj


def _register_plugin(registry: Registry, pm: pluggy.PluginManager, plugin: object,
                     origin: Origin) -> None:
    """Run every registration hook of one plugin; on any failure, roll back its entries."""
    reason = _check_api(plugin)
    if reason:
        _fail(registry, origin, "api", reason)
        return
    before = {k: dict(v) for k, v in registry.entries.items()}
    try:
        pm.register(plugin, name=origin.plugin)
        for kind, hook in HOOK_FOR_KIND.items():
            impls = [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin is plugin]
            for impl in impls:
                impl.function(register=_Register(registry, kind, origin))
    except Exception as exc:  # noqa: BLE001
        registry.entries = before
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        _fail(registry, origin, "register", f"{type(exc).__name__}: {exc}",
              traceback.format_exc())
        return
    registry.plugins.append(origin)


def _fail(registry: Registry, origin: Origin, stage: str, error: str, detail: str = "") -> None:
    registry.failures.append(Failure(origin, stage, error, detail))
    if strict_mode():
        raise PluginError(f"plugin {origin.describe()} failed at {stage}: {error}")
    log.warning("skipping plugin %s (%s failed): %s", origin.describe(), stage, error)


def _entry_points() -> Iterable[md.EntryPoint]:
    seen = set()
    for ep in md.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        key = (ep.name, ep.value)
        if key not in seen:  # the same dist can appear twice on sys.path
            seen.add(key)
            yield ep


def build_registry(extra: Iterable[tuple[str, object]] = (), entry_points: bool = True
                   ) -> Registry:
    """Discover plugins and build a fresh registry.

    `extra` is a list of (name, plugin object) registered in-process after the entry points, the
    way tests and embedding applications add plugins.
    """
    registry = Registry()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    allow, deny = _env_list("CORE_PLUGINS_ALLOW"), _env_list("CORE_PLUGINS_DENY")
    if entry_points:
        dists: dict[object, tuple[str, str]] = {}  # a distribution's metadata is parsed once
        for ep in _entry_points():
            dist, version = "<unknown>", ""
            if ep.dist is not None:
                key = getattr(ep.dist, "_path", None) or id(ep.dist)
                if key not in dists:
                    meta = ep.dist.metadata
                    dists[key] = (meta["Name"], meta["Version"])
                dist, version = dists[key]
            origin = Origin(ep.name, dist, version)
            names = {ep.name, dist}
            if allow is not None and not names & allow:
                continue
            if deny is not None and names & deny:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001
                _fail(registry, origin, "import", f"{type(exc).__name__}: {exc}",
                      traceback.format_exc())
                continue
            _register_plugin(registry, pm, plugin, origin)
    for name, plugin in extra:
        _register_plugin(registry, pm, plugin, Origin(name, "<in-process>"))
    return registry


_lock = threading.Lock()
_cached: Registry | None = None
_extra: list[tuple[str, object]] = []


def get_registry(reload: bool = False) -> Registry:
    """The process-wide registry; loading is idempotent (done once unless reload=True)."""
    global _cached
    with _lock:
        if _cached is None or reload:
            _cached = build_registry(extra=list(_extra))
        return _cached


def add_plugin(name: str, plugin: object) -> None:
    """Register an in-process plugin for this process (takes effect at the next load)."""
    with _lock:
        _extra.append((name, plugin))
    get_registry(reload=True)


def remove_plugin(name: str) -> None:
    with _lock:
        _extra[:] = [(n, p) for n, p in _extra if n != name]
    get_registry(reload=True)
