"""Tokenizer wrapper: encode / decode, streaming detokenization, EOS ids, chat template."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from core.contract.json_types import JSON, JSONObject

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    import jinja2.parser
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerBase

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback

# What tokenizer_record reads off transformers' tokenizer (the cache's record.json); "class" is
# a keyword, hence the functional form.
TokenizerRecord = TypedDict("TokenizerRecord", {
    "usable": bool, "class": str, "eos_token_id": int | None, "bos_token_id": int | None,
    "len": int, "special_tokens": list[str], "special_tokens_map": dict[str, str],
    "chat_template": str | None, "added_ids": list[int]})


class Tokenizer:
    """A thin wrapper over a transformers tokenizer, built from an HF directory or a GGUF file.

    From a GGUF file whose cache entry (core.plan.gguf_cache) holds the converted tokenizer, it runs
    on the `tokenizers` package directly (the tokenizer.json transformers' own tokenizer runs
    on) and renders chat templates with jinja2 as transformers does: no transformers import.
    `hf`, transformers' tokenizer, is then built on first use (grammar backends read it).
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase,
                 eos_token_ids: set[int] | None = None, chat_template: str | None = None):
        self._hf: PreTrainedTokenizerBase | None = hf_tokenizer  # None: built by _load_hf
        self._hf_lock = threading.Lock()
        self._load_hf: Callable[[], PreTrainedTokenizerBase] | None = None
        self._fast: Backend | None = None  # where transformers is not needed
        self._special_map: dict[str, str] = {}
        self._added_ids: frozenset[int] = frozenset()
        ids = set(eos_token_ids or ())
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = ids
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.special_tokens: tuple[str, ...] = _special_texts(hf_tokenizer)
        self._bytes: dict[int, bytes] = {}
        self._byte_level: bool | None = None
        self._unicode_to_byte: dict[str, int] = {}

    @classmethod
    def _from_record(cls, backend: Backend, record: TokenizerRecord,
                     load_hf: Callable[[], PreTrainedTokenizerBase],
                     hf: PreTrainedTokenizerBase | None = None,
                     eos_token_ids: set[int] | None = None,
                     chat_template: str | None = None) -> Tokenizer:
        """On `backend` (a tokenizers.Tokenizer), with what tokenizer_record read off
        transformers' tokenizer; `load_hf` builds that tokenizer when `hf` is first read."""
        self = cls.__new__(cls)
        self._hf, self._hf_lock, self._load_hf = hf, threading.Lock(), load_hf
        # what transformers' encode() sets on its backend before every call
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        backend.encode_special_tokens = False
        self._fast = backend
        self._special_map = dict(record["special_tokens_map"])
        self._added_ids = frozenset(int(i) for i in record["added_ids"])
        ids = set(eos_token_ids or ())
        if record["eos_token_id"] is not None:
            ids.add(int(record["eos_token_id"]))
        self.eos_token_ids = ids
        self.chat_template = chat_template or record["chat_template"]
        self.vocab_size = int(record["len"])
        self.bos_token_id = record["bos_token_id"]
        self.special_tokens = tuple(record["special_tokens"])
        self._bytes, self._byte_level, self._unicode_to_byte = {}, None, {}
        return self

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """transformers' tokenizer (built on first use where the wrapper runs without it)."""
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    assert self._load_hf is not None
                    self._hf = self._load_hf()
        return self._hf

    @classmethod
    def from_path(cls, path: str, gguf_file: str | None = None,
                  chat_template: str | None = None, trust_remote_code: bool = False
                  ) -> Tokenizer:
        """Load from an HF directory (or the GGUF file `gguf_file` inside `path`).

        chat_template: a Jinja file or string overriding the tokenizer's own template.
        trust_remote_code: run a checkpoint's own tokenizer code (--trust-remote-code); without
        it such a tokenizer is refused, never asked about on the terminal.
        EOS ids gather the tokenizer's EOS and generation_config.json / config.json's.
        """
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer path {path!r} is not a directory")
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos |= _eos_from_json(os.path.join(path, name))
        template = _read_template(chat_template) if chat_template else None
        try:
            # read off transformers' tokenizer once, then run on the `tokenizers` package (not
            # with remote code, whose classes can change while the files do not)
            from core.plan.gguf_cache import enabled

            built: list[PreTrainedTokenizerBase] = []  # where the cache's build made one
            if not trust_remote_code and enabled():
                fast = _fast_cached(path, gguf_file, eos, template, built)
                if fast is not None:
                    return _gguf_end_ids(fast, os.path.join(path, gguf_file)) if gguf_file \
                        else fast
            hf = built[0] if built else _hf_tokenizer(path, gguf_file, trust_remote_code)
        except Exception as exc:  # transformers raises many kinds; one clear message here
            raise ValueError(f"cannot load a tokenizer from {path!r}"
                             f"{f' ({gguf_file})' if gguf_file else ''}: {exc}") from exc
        tok = cls(hf, eos, template)
        return _gguf_end_ids(tok, os.path.join(path, gguf_file)) if gguf_file else tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for, read from the vocabulary (not from decoding it
        alone, which turns part of a multi-byte character into U+FFFD): byte-level BPE pieces
        through the GPT-2 byte alphabet, SentencePiece `<0xNN>` pieces as that byte, `▁` as a
        space, added / special tokens as their text."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        if self._fast is not None:
            piece = self._fast.id_to_token(int(token_id))
            is_added = int(token_id) in self._added_ids
        else:
            hf = self.hf
            piece = hf.convert_ids_to_tokens(int(token_id))
            is_added = int(token_id) in (getattr(hf, "added_tokens_decoder", None) or {})
        if piece is None:
            out = b""
        elif is_added:
            out = piece.encode("utf-8")
        elif self._is_byte_level() and all(c in self._unicode_to_byte for c in piece):
            out = bytes(self._unicode_to_byte[c] for c in piece)
        elif m := _BYTE_TOKEN.fullmatch(piece):
            out = bytes([int(m.group(1), 16)])
        else:
            out = piece.replace("\u2581", " ").encode("utf-8")
        self._bytes[token_id] = out
        return out

    def _is_byte_level(self) -> bool:
        if self._byte_level is None:
            backend = self._fast if self._fast is not None else \
                getattr(self.hf, "backend_tokenizer", None)
            self._byte_level = _has_byte_level_decoder(backend)
            if self._byte_level:
                self._unicode_to_byte = {c: b for b, c in _gpt2_byte_alphabet().items()}
        return self._byte_level

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[JSONObject] | None = None, **kwargs: Any) -> str:
        """Render chat messages to a prompt string with the model's (or overriding) template.

        tools: function definitions in OpenAI's shape, the template's `tools` variable (as
        HF's apply_chat_template); a template that never reads it renders as without."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass --chat-template")
        if self._fast is not None and isinstance(self.chat_template, str):
            try:
                return render_chat(self.chat_template, messages, add_generation_prompt, tools,
                                   self._special_map, kwargs)
            except _Unsupported:
                pass  # a shape only transformers' renderer takes: it renders it below
        return self.hf.apply_chat_template(messages, chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           tokenize=False, tools=tools, **kwargs)

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


def _special_texts(hf: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Control tokens' texts (special added tokens, e.g. <|im_start|>), longest first."""
    added = getattr(hf, "added_tokens_decoder", None) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts |= set(getattr(hf, "all_special_tokens", None) or ())
    return tuple(sorted(texts, key=lambda t: (-len(t), t)))


def _hf_tokenizer(path: str, gguf_file: str | None, trust_remote_code: bool = False
                  ) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of an HF directory, or of a GGUF file: converted from its
    vocabulary once (core.plan.gguf_cache), then read back."""
    from transformers import AutoTokenizer

    if not gguf_file:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    from core.plan.gguf_cache import cached

    return cached(os.path.join(path, gguf_file), "tokenizer", "tokenizer.json",
                  lambda: AutoTokenizer.from_pretrained(path, gguf_file=gguf_file),
                  AutoTokenizer.from_pretrained)


TOKENIZER_RECORD_VERSION = 1  # of tokenizer_record's layout: a change misses the old entries
# what transformers' fast tokenizer class does itself; a class overriding any of them may
# encode, decode or render differently than its backend does, so it keeps transformers
_RECORDED_METHODS = ("encode", "decode", "_decode", "_encode_plus", "__call__",
                     "convert_ids_to_tokens", "_convert_id_to_token", "apply_chat_template",
                     "get_chat_template", "__len__")


def tokenizer_record(hf: PreTrainedTokenizerBase) -> TokenizerRecord:
    """What the wrapper reads off transformers' tokenizer `hf`, as JSON, and whether the
    `tokenizers` backend alone gives what `hf` gives (`usable`): a fast tokenizer of the
    plain class whose backend survives serialization, no clean-up of decoded spaces or
    splitting of special tokens, one chat template (or none)."""
    from tokenizers import Tokenizer as Backend
    from transformers import TokenizersBackend

    backend = getattr(hf, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else None
    exact = state is not None and Backend.from_str(state).to_str() == state
    plain = all(getattr(type(hf), m, None) is getattr(TokenizersBackend, m, None)
                for m in _RECORDED_METHODS)
    template = getattr(hf, "chat_template", None)
    usable = (exact and plain and isinstance(hf, TokenizersBackend)
              and not getattr(hf, "clean_up_tokenization_spaces", False)
              and not getattr(hf, "split_special_tokens", False)
              and (template is None or isinstance(template, str)))
    added = getattr(hf, "added_tokens_decoder", None) or {}
    return {"usable": bool(usable), "class": type(hf).__name__,
            "eos_token_id": hf.eos_token_id, "bos_token_id": hf.bos_token_id,
            "len": len(hf), "special_tokens": list(_special_texts(hf)),
            "special_tokens_map": dict(getattr(hf, "special_tokens_map", None) or {}),
            "chat_template": template if isinstance(template, str) else None,
            "added_ids": sorted(int(i) for i in added)}


def _fast_cached(path: str, gguf_file: str | None, eos: set[int], template: str | None,
                 made: list[PreTrainedTokenizerBase]) -> Tokenizer | None:
    """The tokenizer of the GGUF file (or, gguf_file None, of the HF directory `path`) on the
    `tokenizers` package: its record and tokenizer.json in the cache entry of the file (of the
    directory), made from transformers' tokenizer once; None where the record says the backend
    alone would not give what transformers gives. `made` receives transformers' tokenizer
    where this call built it (the caller then uses it rather than building another)."""
    from tokenizers import Tokenizer as Backend

    from core.plan.gguf_cache import cached

    key = os.path.join(path, gguf_file) if gguf_file else path

    def build() -> tuple[TokenizerRecord, Backend | None]:
        hf = _hf_tokenizer(path, gguf_file)
        made.append(hf)
        record = tokenizer_record(hf)  # a slow tokenizer (no backend) is not usable
        return record, Backend.from_str(hf.backend_tokenizer.to_str()) \
            if record["usable"] else None

    def save(obj: tuple[TokenizerRecord, Backend | None], where: str) -> None:
        record, backend = obj
        if backend is not None:
            with open(os.path.join(where, "tokenizer.json"), "w", encoding="utf-8") as fh:
                fh.write(backend.to_str())
        with open(os.path.join(where, "record.json"), "w", encoding="utf-8") as fh:
            json.dump(record, fh)  # written last: its presence says the part is whole

    def load(where: str) -> tuple[TokenizerRecord, Backend | None]:
        with open(os.path.join(where, "record.json"), encoding="utf-8") as fh:
            record = json.load(fh)
        return record, Backend.from_file(os.path.join(where, "tokenizer.json")) \
            if record.get("usable") else None

    record, backend = cached(key, f"tokenizer-fast-v{TOKENIZER_RECORD_VERSION}",
                             "record.json", build, load, save)
    if backend is None or not record.get("usable"):
        return None
    return Tokenizer._from_record(backend, record, lambda: _hf_tokenizer(path, gguf_file),
                                  made[0] if made else None, eos, template)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    `add(ids)` returns only newly complete text. Pieces that end inside a multi-byte character
    decode to U+FFFD; such text is held back until a later token completes it. Decoding a small
    window of preceding tokens keeps word-boundary spaces right for tokenizers that drop a
    leading space when decoding a lone piece.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-6:]  # context only, never emitted
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    # Held-back tokens beyond this are emitted anyway (a model can emit invalid UTF-8 forever;
    # waiting would make every later call decode an ever longer window).
    MAX_PENDING = 16

    def add(self, new_ids: list[int] | int) -> str:
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        pending = len(self.ids) - self.read_offset
        if len(full) <= len(prefix) or (full.endswith("\ufffd")
                                         and pending < self.MAX_PENDING):
            return ""  # nothing new, or an incomplete character at the end: wait
        delta = full[len(prefix):] if full.startswith(prefix) else full
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back (e.g. a dangling partial character) at the end."""
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def _has_byte_level_decoder(backend: Backend | None) -> bool:
    """Whether a `tokenizers` backend decodes with `ByteLevel` (alone or inside a Sequence)."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False

    def walk(d: JSON) -> bool:
        return isinstance(d, dict) and (d.get("type") == "ByteLevel"
                                        or any(walk(x) for x in d.get("decoders") or ()))

    return walk(spec)


def _gpt2_byte_alphabet() -> dict[int, str]:
    """byte -> the printable character byte-level BPE writes it as: printable Latin-1 bytes
    stand for themselves, the other 68 are shifted past U+00FF in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


# GGUF architectures whose chat turns end with this token: llama.cpp ends generation there
# (its vocabulary loader takes the token as end-of-generation by its text), though the file's
# eos_token_id is <eos>; HF's checkpoints list it in generation_config.json, which a GGUF lacks
_GGUF_END_OF_TURN = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}


def _gguf_end_ids(tok: Tokenizer, gguf: str) -> Tokenizer:
    """`tok` with the GGUF file's other end-of-generation tokens among its EOS ids: the
    header's eot / eom token ids, and its architecture's end-of-turn token (Gemma's)."""
    from core.plan.gguf_metadata import read_gguf_metadata

    meta = read_gguf_metadata(gguf)
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.fields.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            tok.eos_token_ids.add(value)
    text = _GGUF_END_OF_TURN.get(meta.architecture)
    if text is not None:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == 1:  # a token of its own (absent from a base model's vocabulary: no id)
            tok.eos_token_ids.add(ids[0])
    return tok


def _eos_from_json(path: str) -> set[int]:
    if not os.path.isfile(path):
        return set()
    with open(path) as fh:
        value = json.load(fh).get("eos_token_id")
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}


def _read_template(value: str) -> str:
    if os.path.isfile(value):
        with open(value) as fh:
            return fh.read()
    return value


# -- chat templates, rendered as transformers renders them (without importing it) ---------------

class _Unsupported(Exception):
    """An input render_chat leaves to transformers' apply_chat_template."""


# apply_chat_template's own parameters: a call with any of them goes to transformers
_HF_ONLY_KWARGS = frozenset({"documents", "continue_final_message", "tokenize",
                             "sanitize_control_tokens", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs", "chat_template", "conversation"})
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the standard


def _plain(value: object) -> Any:  # JSON, with tuples kept as tuples
    """A copy of a JSON-shaped value (what the template sees); other objects -> _Unsupported
    (transformers turns them into placeholders, dataclasses and models into dicts)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    raise _Unsupported(type(value).__name__)


def render_chat(template: str, messages: object, add_generation_prompt: bool,
                tools: list[JSONObject] | None, special_tokens_map: dict[str, str],
                kwargs: dict[str, object]) -> str:
    """transformers' apply_chat_template(messages, chat_template=template, tokenize=False,
    add_generation_prompt=..., tools=..., **kwargs) for one conversation of plain dicts and
    tools given as JSON schemas: messages' None-valued keys dropped, reasoning copied under
    its aliases (`thinking`, `reasoning_content`), the tokenizer's named special tokens and
    `kwargs` as template variables, the same sandboxed jinja2 environment. _Unsupported for
    anything else (batches, callables as tools, documents, continue_final_message, ...)."""
    if _HF_ONLY_KWARGS & kwargs.keys():
        raise _Unsupported("apply_chat_template options")
    if not isinstance(messages, list | tuple) or not messages:
        raise _Unsupported("an empty or batched conversation")  # transformers says why
    chat = []
    for message in messages:
        if type(message) is not dict:
            raise _Unsupported("a message that is not a dict")
        m = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    if tools is not None and not all(type(t) is dict for t in tools):
        raise _Unsupported("tools that are not JSON schemas")
    variables = _plain({**special_tokens_map, **kwargs})
    return _compiled(template).render(messages=chat, tools=_plain(tools), documents=None,
                                      add_generation_prompt=add_generation_prompt,
                                      **variables)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """The template compiled in an environment like transformers': sandboxed (immutable),
    trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` block (rendered as
    its body), a `tojson` that keeps non-ASCII text, raise_exception, strftime_now, and `dict`
    / `namespace` that refuse underscore attributes."""
    import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise _Unsupported("jinja2 older than 3.1.6")  # transformers refuses it, saying so

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 - jinja2's class attribute

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    class Dict:
        def __call__(self, *args: Any, **kw: Any) -> dict:
            return dict(*args, **kw)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    def refuse_private(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute.")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kw: Any) -> None:  # noqa: N805 - jinja2's signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kw)
            for name in attrs:
                refuse_private(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: object) -> None:
            refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)
