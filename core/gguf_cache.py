"""A disk cache of what transformers converts out of a GGUF file: its config and tokenizer.

transformers builds both from the GGUF header by parsing every field with the `gguf` package
(the tokenizer's ~10^5 strings included) and converting the vocabulary: seconds per start, on
the client and again in the engine worker. The first load saves the results with
`save_pretrained` under a key of the file's path, size and modification time and the
transformers version; later loads read those (config.json, tokenizer.json). A changed file,
or another transformers, misses the cache; a broken entry is rebuilt. $CORE_GGUF_CACHE (else
~/.cache/core-serve/gguf) is the location; CORE_GGUF_CACHE=off turns it off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _root() -> Path | None:
    value = os.environ.get("CORE_GGUF_CACHE")
    if value and value.lower() in ("off", "0", "none"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "core-serve" / "gguf"


def entry(gguf_path: str) -> Path | None:
    """The cache directory of this file (None when caching is off)."""
    root = _root()
    if root is None:
        return None
    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    return root / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def cached(gguf_path: str, part: str, marker: str, build: Callable[[], Any],
           load: Callable[[str], Any]) -> Any:
    """`load(dir)` of the cached `part` ("config" / "tokenizer"), or `build()` saved there.
    `marker` is the file whose presence says the part was saved whole."""
    where = entry(gguf_path)
    if where is not None:
        target = where / part
        if (target / marker).is_file():
            try:
                return load(str(target))
            except Exception:  # an entry another version broke: rebuild it below
                shutil.rmtree(target, ignore_errors=True)
    obj = build()
    if where is not None:
        try:
            where.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=where, prefix=f".{part}-"))
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
