"""A disk cache of what transformers converts out of a GGUF file: its config and tokenizer.

transformers builds both from the GGUF header by parsing every field with the `gguf` package
(the tokenizer's ~10^5 strings included) and converting the vocabulary: seconds per start, on
the client and again in the engine worker. The first load saves the results with
`save_pretrained` under a key of the file's path, size and modification time and the
transformers version; later loads read those (config.json, tokenizer.json). A changed file,
or another transformers, misses the cache; a broken entry is rebuilt. $CORE_GGUF_CACHE (else
~/.cache/core-serve/gguf) is the location; CORE_GGUF_CACHE=off turns it off.

Beside those, parts that let a later start run without importing transformers at all (a
second or more of every start, in the client and in the worker): the model spec
(core.plan.model_spec), the config's attributes (core.engine.loader) and what the tokenizer wrapper reads
off transformers' tokenizer (core.tokenizer), each one JSON file written by `cached_json`
from the objects transformers built. The key names the transformers version from its
distribution's metadata, so finding the entry imports nothing.

A model directory's config.json gets an entry of its own the same way (its path, size,
modification time and the transformers version): the model spec and the config's attributes
derived from it; and the directory one (keyed by the names, sizes and modification times of
its files but the weights): its tokenizer. So a restart of an HF checkpoint reads its config
and tokenizer without transformers too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from core.contract.file_lock import exclusive
from core.contract.json_types import JSON

T = TypeVar("T")


def _root() -> Path | None:
    value = os.environ.get("CORE_GGUF_CACHE")
    if value and value.lower() in ("off", "0", "none"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "core-serve" / "gguf"


def enabled() -> bool:
    """Whether the cache is on (CORE_GGUF_CACHE is not `off`): what `entry(...) is not None`
    says, without stat-ing, scanning or hashing anything."""
    return _root() is not None


def entry(gguf_path: str) -> Path | None:
    """The cache directory of this file (a .gguf or a config .json) or model directory (keyed
    by every file in it but the weights: its tokenizer's files among them); None when caching
    is off."""
    root = _root()
    if root is None:
        return None
    real = os.path.realpath(gguf_path)
    if os.path.isdir(real):
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(real)
                       if e.is_file() and not e.name.endswith(WEIGHT_SUFFIXES))
        key = f"{real}|{files}|{_transformers_version()}"
        name = os.path.basename(real) + "-dir"
    else:
        st = os.stat(gguf_path)
        key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{_transformers_version()}"
        name = os.path.basename(gguf_path).removesuffix(".gguf")
        if name == "config.json":  # named by its folder, the model's name
            name = os.path.basename(os.path.dirname(real)) + "-config"
    return root / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


# files a directory's entry leaves out of its key: weights, which no cached part reads
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def _transformers_version() -> str:
    """transformers' version as its metadata says (what `transformers.__version__` reads),
    without importing it; "none" when it is not installed."""
    return package_versions("transformers")


@functools.cache
def package_versions(*names: str) -> str:
    """The installed versions of these distributions ("none" for a missing one), joined by
    "-", read from their metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in names:
        try:
            out.append(version(name))
        except PackageNotFoundError:
            out.append("none")
    return "-".join(out)


def cached(gguf_path: str, part: str, marker: str, build: Callable[[], T],
           load: Callable[[str], T], save: Callable[[T, str], None] | None = None) -> T:
    """`load(dir)` of the cached `part` ("config" / "tokenizer"), or `build()` saved there
    (by `save(obj, dir)`, else obj.save_pretrained(dir): without `save`, T is a transformers
    object). `marker` is the file whose presence says the part was saved whole. Processes that
    miss the same part at once (the server and its engine worker, on a new machine) build it
    once: the first holds the part's lock while it builds, the others wait for it (at most
    LOCK_WAIT_S, then build their own) and read what it saved."""
    where = entry(gguf_path)
    if where is None:
        return build()
    with _part_lock(where, part):
        target = where / part
        if (target / marker).is_file():
            try:
                return load(str(target))
            except Exception:  # an entry another version broke: rebuild it below
                shutil.rmtree(target, ignore_errors=True)
        obj = build()
        try:
            where.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=where, prefix=f".{part}-"))
            if save is not None:
                save(obj, str(tmp))
            else:
                obj.save_pretrained(str(tmp))
            if (tmp / marker).is_file():
                try:
                    os.replace(tmp, where / part)  # atomic; a racing writer's copy is as good
                except OSError:
                    pass
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # a read-only home: no cache, still loads
    return obj


LOCK_WAIT_S = 300.0  # the longest a process waits for another's build of a part


@contextlib.contextmanager
def _part_lock(where: Path, part: str) -> Iterator[None]:
    """An exclusive lock on `part` of the entry `where` (core.contract.file_lock: a lock file
    beside it; waited for at most LOCK_WAIT_S, and where none can be taken the caller goes on
    without it: a racing build is only duplicated work, its result replaced atomically)."""
    with exclusive(where / f".{part}.lock", LOCK_WAIT_S):
        yield


def cached_json(gguf_path: str, part: str, build: Callable[[], JSON]) -> JSON:
    """The JSON value cached as `part` of this file's entry, or `build()` (a JSON value)
    saved there. A build that raises is not cached (the error propagates)."""

    def save(value: JSON, where: str) -> None:
        with open(os.path.join(where, "value.json"), "w", encoding="utf-8") as fh:
            json.dump(value, fh)

    def load(where: str) -> JSON:
        with open(os.path.join(where, "value.json"), encoding="utf-8") as fh:
            return json.load(fh)

    return cached(gguf_path, part, "value.json", build, load, save)


def source_digest(*modules: str) -> str:
    """A short digest of these modules' source files (names like "core.plan.model_spec", under
    this package's parent): a cached part derived by their code is keyed by it, so an edit
    of the code misses the cache instead of reading what the old code derived."""
    h = hashlib.sha256()
    top = Path(__file__).resolve().parents[2]  # the folder holding the core package
    for name in modules:
        h.update((top / (name.replace(".", os.sep) + ".py")).read_bytes())
    return h.hexdigest()[:12]
