"""A CI-sized soak (issue 16): mixed traffic (completions, streams read to the end and cut,
n=2, malformed requests, probes) for SOAK_S seconds against a server on the fake engine with a
small admission limit. Nothing may fail on the server's side, and afterwards nothing may be left
behind: engine requests, KV pages, reserved rids, in-flight jobs, open sockets. The long soak
against the real engine, with RSS slopes, is bench/soak.py."""

from __future__ import annotations

import asyncio
import os
import time

from conformance.server_kit import FakeEngine, ServerThread, soak_traffic
from core.plan.args import ServerArgs
from core.server.app import create_app
from core.server.state import STATE

SOAK_S = 12.0
KEY = "sk-soak"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def test_short_soak_leaves_nothing_behind():
    eng = FakeEngine(token_delay=0.002)
    args = ServerArgs(api_key=KEY, max_running_requests=6, max_queued_requests=6)
    with ServerThread(create_app(eng, args)) as s:
        st = s.app[STATE]
        idle_pages = s.call(eng.pages_in_use)
        fds0 = _open_fds()
        counts = asyncio.run(soak_traffic(s.url, KEY, SOAK_S, concurrency=16, max_tokens=24))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (s.call(lambda: len(eng.active)) or st.inflight):
            time.sleep(0.05)
        left = s.call(lambda: (len(eng.active), eng.pages_in_use(), set(st.rids), len(st.jobs),
                               st.inflight, st.active_sequences))
        fds1 = _open_fds()
    assert counts["requests"] > 200, counts
    assert counts["server_error"] == 0 and counts["transport"] == 0, counts["examples"]
    assert counts["unexpected"] == 0, counts["examples"]
    # the admission limit turns some away with 503 + Retry-After; most of the rest succeed
    assert counts["client_error"] > 0 and counts["ok"] > counts["requests"] // 4, counts
    assert left == (0, idle_pages, set(), 0, 0, 0), left
    assert fds1 <= fds0 + 8, (fds0, fds1)  # no sockets or files left open
