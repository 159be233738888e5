"""Tokenizer wrapper: encode / decode, streaming detokenization, EOS ids, chat template."""

from __future__ import annotations

import json
import os
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class Tokenizer:
    """A thin wrapper over a transformers tokenizer, built from an HF directory or a GGUF file."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: set[int] | None = None,
                 chat_template: str | None = None):
        self.hf = hf_tokenizer
        ids = set(eos_token_ids or ())
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = ids
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        # control tokens' texts (special added tokens, e.g. <|im_start|>), longest first
        added = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
        texts = {t.content for t in added.values() if getattr(t, "special", False)}
        texts |= set(getattr(hf_tokenizer, "all_special_tokens", None) or ())
        self.special_tokens: tuple[str, ...] = tuple(sorted(texts, key=lambda t: (-len(t), t)))
        self._bytes: dict[int, bytes] = {}
        self._byte_level: bool | None = None
        self._unicode_to_byte: dict[str, int] = {}

    @classmethod
    def from_path(cls, path: str, gguf_file: str | None = None,
                  chat_template: str | None = None) -> Tokenizer:
        """Load from an HF directory (or the GGUF file `gguf_file` inside `path`).

        chat_template: a Jinja file or string overriding the tokenizer's own template.
        EOS ids gather the tokenizer's EOS and generation_config.json / config.json's.
        """
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ValueError(f"tokenizer path {path!r} is not a directory")
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            if gguf_file:  # converted from the GGUF vocabulary once, then read back
                from core.gguf_cache import cached

                hf = cached(os.path.join(path, gguf_file), "tokenizer", "tokenizer.json",
                            lambda: AutoTokenizer.from_pretrained(path, **kw),
                            AutoTokenizer.from_pretrained)
            else:
                hf = AutoTokenizer.from_pretrained(path, **kw)
        except Exception as exc:  # transformers raises many kinds; one clear message here
            raise ValueError(f"cannot load a tokenizer from {path!r}"
                             f"{f' ({gguf_file})' if gguf_file else ''}: {exc}") from exc
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos |= _eos_from_json(os.path.join(path, name))
        template = _read_template(chat_template) if chat_template else None
        return cls(hf, eos, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for, read from the vocabulary (not from decoding it
        alone, which turns part of a multi-byte character into U+FFFD): byte-level BPE pieces
        through the GPT-2 byte alphabet, SentencePiece `<0xNN>` pieces as that byte, `▁` as a
        space, added / special tokens as their text."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        hf = self.hf
        piece = hf.convert_ids_to_tokens(int(token_id))
        added = getattr(hf, "added_tokens_decoder", None) or {}
        if piece is None:
            out = b""
        elif int(token_id) in added:
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
            self._byte_level = _has_byte_level_decoder(self.hf)
            if self._byte_level:
                self._unicode_to_byte = {c: b for b, c in _gpt2_byte_alphabet().items()}
        return self._byte_level

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render chat messages to a prompt string with the model's (or overriding) template.

        tools: function definitions in OpenAI's shape, the template's `tools` variable (as
        HF's apply_chat_template); a template that never reads it renders as without."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass --chat-template")
        return self.hf.apply_chat_template(messages, chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           tokenize=False, tools=tools, **kwargs)

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


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


def _has_byte_level_decoder(hf: Any) -> bool:
    """Whether a fast tokenizer decodes with `ByteLevel` (alone or inside a Sequence)."""
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False

    def walk(d: Any) -> bool:
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
