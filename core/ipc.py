"""Messages between the client (parent) and the engine worker: JSON over a multiprocessing pipe.

Every message is one UTF-8 JSON object sent with `Connection.send_bytes`; nothing is pickled.
A message is a dict with a "type":

client -> worker
  {"type": "add", "rid", "input_ids", "params": SamplingParams.to_dict(), "priority"}
  {"type": "abort", "rid"}
  {"type": "rpc", "id", "op": "stats" | "check_accounting" | "flush_cache"}
  {"type": "shutdown"}
worker -> client
  {"type": "ready", "info": {...}}            once, after the model is loaded
  {"type": "fatal", "error", "traceback"}     the worker is about to exit
  {"type": "out", "items": [{"rid", "ids", "lps", "finish", "prompt_tokens",
                             "completion_tokens", "cached_tokens"}]}   once per step
  {"type": "reply", "id", "ok", "result" | "error"}
  {"type": "heartbeat", "stats", "step_s"}     every second, from a thread of the worker
"""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any


class ChannelClosed(EOFError):
    """The other end of the pipe is gone (process exited or closed its end)."""


def encode(msg: dict[str, Any]) -> bytes:
    # -inf logprobs travel as -Infinity (both ends are Python's json).
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    msg = json.loads(data)
    if not isinstance(msg, dict) or "type" not in msg:
        raise ValueError(f"malformed engine message: {data[:80]!r}")
    return msg


class Channel:
    """One end of the pipe, speaking JSON messages."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.conn.send_bytes(encode(msg))
        except (OSError, ValueError) as exc:  # ValueError: the connection was closed here
            raise ChannelClosed(str(exc)) from exc

    def recv(self) -> dict[str, Any]:
        try:
            return decode(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def poll(self, timeout: float | None) -> bool:
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def close(self) -> None:
        self.conn.close()
