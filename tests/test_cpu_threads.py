"""Engine processes sharing a CPU (tensor-parallel ranks, data-parallel replicas) split its
cores: an even share of threads each and, where there are enough cores, a disjoint slice of the
affinity mask per process (core.engine.distributed.share_threads; issue 38 item 3)."""

from __future__ import annotations

import os

import pytest
import torch

from core.engine import distributed
from core.frontend.client import rank_specs
from core.plan.args import make_server_args
from core.plan.devices import PROFILES


@pytest.fixture
def cpu(monkeypatch):
    """A host of 4 cores (ids 2, 3, 6, 7 in this process's mask), recording what is set."""
    got = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 6, 7}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity",
                        lambda pid, cores: got.__setitem__("cores", sorted(cores)),
                        raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: got.__setitem__("threads", n))
    return got


def test_one_process_keeps_every_core(cpu):
    assert distributed.share_threads(1) is None
    assert cpu == {}


@pytest.mark.parametrize("slot,cores", [(0, [2, 3]), (1, [6, 7])])
def test_each_process_gets_its_own_slice(cpu, slot, cores):
    note = distributed.share_threads(2, slot)
    assert cpu == {"threads": 2, "cores": cores}
    assert f"engine process {slot + 1} of 2" in note and "pinned" in note


def test_four_processes_one_core_each(cpu):
    seen = []
    for slot in range(4):
        distributed.share_threads(4, slot)
        seen.append(cpu["cores"])
    assert seen == [[2], [3], [6], [7]] and cpu["threads"] == 1


def test_more_processes_than_cores_share_without_pinning(cpu):
    note = distributed.share_threads(6, 5)
    assert cpu == {"threads": 1}
    assert "not pinned" in note


def test_rank_specs_give_every_process_of_the_node_its_own_slot():
    device = PROFILES["x86-cpu"]
    args = make_server_args(tp_size=2, dp_size=2, device_profile="x86-cpu")
    slots = [s.slot for replica in (0, 1) for s in rank_specs(args, device, replica)]
    assert slots == [0, 1, 2, 3]
    spec = rank_specs(args, device, 1)[1]
    assert distributed.RankSpec.from_json(spec.to_json()) == spec
