"""The start-up prebuild of C kernels (core.plan.prebuild, plugins._kit.cbuild.compiled):
which entries a plan prebuilds, that the compiles land in the cache the engine then reads
without compiling again, and that concurrent builders of one library compile it once."""

from __future__ import annotations

import json
import shutil
import stat
import threading
from pathlib import Path

import pytest

from core.contract.capabilities import c_compiler
from plugins._kit import cbuild

pytestmark = pytest.mark.skipif(c_compiler() is None, reason="no C compiler on this machine")

OPS_C = Path(cbuild.__file__).parent.parent / "ops" / "cpu_c" / "ops.c"


@pytest.fixture
def counting_cc(tmp_path, monkeypatch):
    """CC set to a wrapper of the real compiler that logs each compile (not --version) and
    takes 0.3 s longer; CORE_KERNEL_CACHE an empty directory. Yields the log's path."""
    real = shutil.which(c_compiler())
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f"""#!/bin/sh
case "$1" in --version) exec {real} "$@" ;; esac
for a in "$@"; do case "$a" in *.c) echo "$a" >> {log} ;; esac; done
sleep 0.3
exec {real} "$@"
""")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("CORE_KERNEL_CACHE", str(tmp_path / "kernels"))
    cbuild.build.cache_clear()
    yield log
    cbuild.build.cache_clear()


def compiles(log: Path) -> list[str]:
    return [Path(ln).name for ln in log.read_text().split()] if log.exists() else []


def test_concurrent_builders_of_one_library_compile_it_once(counting_cc):
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(cbuild.compiled(OPS_C, "portable")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiles(counting_cc) == ["ops.c"]
    assert len(set(paths)) == 1 and paths[0].is_file()
    cbuild.build(OPS_C, "portable")  # loads the file the threads made: no fourth compile
    assert compiles(counting_cc) == ["ops.c"]


def test_a_failed_prebuild_is_quiet_and_build_still_reports_it(counting_cc, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    assert cbuild.prebuild(bad, "portable") is False
    with pytest.raises(RuntimeError, match="building bad.c"):
        cbuild.build(bad, "portable")


def _cpu_plan(tmp_path, configs_dir):
    from core.engine.worker import make_plan
    from core.plan.args import make_server_args

    model = tmp_path / "model"
    model.mkdir()
    cfg = json.loads((configs_dir / "llama-3.1-8b.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg))
    args = make_server_args(model_path=str(model), load_format="dummy", device="cpu",
                            dtype="bfloat16")
    _, plan, _, registry = make_plan(args)
    return plan, registry


def test_a_cpu_plan_prebuilds_its_c_kernels_and_the_engine_compiles_nothing_after(
        counting_cc, tmp_path, configs_dir):
    from core.plan.prebuild import prebuild_entries, start_prebuilds

    plan, registry = _cpu_plan(tmp_path, configs_dir)
    entries = prebuild_entries(plan, registry)
    # the dense model's plan: C attention and C layer ops need a compiler, `unquantized` not
    assert {(r.kind, r.name) for r in entries} == {
        ("attention", plan.decode_attention), ("layer_ops", plan.layer_ops)}
    assert plan.quant_method == "unquantized"
    for t in start_prebuilds(plan, registry):
        t.join(120)
    assert sorted(compiles(counting_cc)) == ["attn.c", "ops.c"]
    # what the engine loads when it builds the backends: the prebuilt files, no compile
    from plugins.attention.cpu_c import backend
    from plugins.ops.cpu_c import ops

    att, lops = (registry.get("attention", plan.decode_attention).load(),
                 registry.get("layer_ops", plan.layer_ops).load())
    backend.library.cache_clear()
    ops.library.cache_clear()
    backend.library(att.variant)
    ops.library(lops.variant)
    assert sorted(compiles(counting_cc)) == ["attn.c", "ops.c"]
    backend.library.cache_clear()
    ops.library.cache_clear()


def test_a_hook_that_raises_is_dropped(monkeypatch):
    from core.plan import prebuild

    class Boom:
        @staticmethod
        def prebuild():
            raise RuntimeError("no")

    class Reg:
        kind, name = "layer_ops", "boom"

        @staticmethod
        def load():
            return Boom

    prebuild._run(Reg())  # returns: the engine's own build reports failures


def test_a_filesystem_without_locks_still_builds(counting_cc, monkeypatch):
    def no_locks(*_):
        raise OSError(37, "No locks available")

    from core.contract import file_lock

    monkeypatch.setattr(file_lock.fcntl, "flock", no_locks)
    assert cbuild.compiled(OPS_C, "portable").is_file()
    assert compiles(counting_cc) == ["ops.c"]
