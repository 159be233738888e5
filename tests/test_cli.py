"""The `core` command, run in-process through core.cli.main (plus one real console-script run)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from core.cli import main
from core.contract.hookspecs import PLUGIN_API_VERSION, hookimpl
from core.plan import registry as plugins

HARDWARE = {"cuda", "rocm", "xpu", "npu", "cpu"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def config(configs_dir: Path, name: str) -> str:
    return str(configs_dir / f"{name}.json")


class BrokenRegistration:
    @hookimpl
    def core_register_attention_backends(self, register):
        raise RuntimeError("cannot find my kernels")


@pytest.fixture
def broken_plugin(clean_plugin_env, monkeypatch):
    """A process-wide in-process plugin that fails to register; the cached registry is dropped
    and restored afterwards by monkeypatch."""
    monkeypatch.setattr(plugins, "_extra", [("broken_plugin", BrokenRegistration())])
    monkeypatch.setattr(plugins, "_cached", None)


# ------------------------------------------------------------------------------- backends

def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available()) and torch.version.hip is None


def test_backends_text_lists_every_kind(capsys, clean_plugin_env):
    code, out, _ = run(capsys, "backends")
    assert code == 0
    assert f"core plugin API {PLUGIN_API_VERSION}" in out
    for kind in ("hardware:", "attention:", "moe:", "quant:", "models:"):
        assert kind in out
    lines = out.splitlines()
    cpu = next(line for line in lines if line.strip().startswith("cpu "))
    assert "[available: cpu:" in cpu and "core-serve" in cpu
    if not _cuda_available():
        cuda = next(line for line in lines if line.strip().startswith("cuda "))
        assert "[unavailable: " in cuda
    assert any(line.strip().startswith("torch_native ") for line in lines)
    assert "pages=any" in out  # the capability summary of torch_native attention


def test_backends_json(capsys, clean_plugin_env):
    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["api_version"] == PLUGIN_API_VERSION
    hardware = {p["name"]: p for p in data["plugins"] if p["kind"] == "hardware"}
    assert HARDWARE <= set(hardware)
    assert hardware["cpu"]["status"] == "available"
    assert hardware["cpu"]["device"].startswith("cpu: ")
    for name, row in hardware.items():
        assert row["status"] in ("available", "unavailable", "failed")
        if row["status"] != "available":
            assert row["reason"], f"{name} is unavailable without a reason"
        assert row["distribution"] and row["summary"].startswith("device_type=")
    if not _cuda_available():
        assert hardware["cuda"]["status"] == "unavailable"
    attention = {p["name"]: p for p in data["plugins"] if p["kind"] == "attention"}
    assert attention["torch_native"]["status"] == "available"
    assert attention["torch_native"]["distribution"] == "core-serve"


def test_backends_marks_a_backend_with_a_missing_package(capsys, global_test_plugins):
    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0
    rows = {(p["kind"], p["name"]): p for p in json.loads(out)["plugins"]}
    missing = rows[("attention", "missing_pkg_like")]
    assert missing["status"] == "unavailable"
    assert missing["reason"] == "package core_test_missing_kernel_pkg is not installed"
    assert missing["distribution"] == "<in-process>"
    assert rows[("attention", "flashmla_like")]["status"] == "available"


def test_backends_lists_load_failures(capsys, broken_plugin):
    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0
    [failure] = [f for f in json.loads(out)["failures"] if f["plugin"] == "broken_plugin"]
    assert failure["stage"] == "register"
    assert "cannot find my kernels" in failure["error"]
    code, out, _ = run(capsys, "backends")
    assert "failed to load:" in out
    assert "broken_plugin (<in-process>) at register: RuntimeError: cannot find my kernels" in out


def test_strict_plugins_failure_exits_3(capsys, broken_plugin, monkeypatch):
    monkeypatch.setenv("CORE_STRICT_PLUGINS", "1")
    code, out, err = run(capsys, "backends")
    assert code == 3
    assert "CORE_STRICT_PLUGINS" in err and "cannot find my kernels" in err
    assert "Traceback" not in err


def test_console_script_backends_json(clean_plugin_env):
    script = Path(sys.executable).parent / "core"
    exe = str(script) if script.exists() else shutil.which("core")
    assert exe, "the `core` console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, "backends", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    names = {(p["kind"], p["name"]) for p in data["plugins"]}
    assert ("hardware", "cpu") in names and ("attention", "torch_native") in names


# -------------------------------------------------------------------------------- resolve

def test_resolve_fixture_on_profile(capsys, configs_dir, clean_plugin_env):
    code, out, _ = run(capsys, "resolve", "--model-path", config(configs_dir, "llama-3.1-8b"),
                       "--device-profile", "h100")
    assert code == 0
    assert "model: LlamaForCausalLM" in out
    assert "NVIDIA H100" in out and "[simulated]" in out
    if importlib.util.find_spec("triton") is not None:
        # triton outranks torch_native on CUDA, and its decode path can be captured.
        assert "prefill attention  triton" in out and "graph capture      on" in out
        return
    assert "prefill attention  torch_native" in out
    # torch_native cannot be captured: the plan says so instead of silently capturing.
    assert "graph capture off: decode attention torch_native cannot be captured" in out


def test_resolve_with_test_plugins_explains_adoption(capsys, configs_dir, global_test_plugins):
    code, out, err = run(capsys, "resolve", "--model-path",
                         config(configs_dir, "deepseek-v2-lite"), "--device-profile", "h200")
    assert code == 0, err
    assert "model impl         deepseek_v2" in out
    assert "decode attention   flashmla_like" in out
    assert "page size 64 adopted: required by flashmla_like" in out
    assert "MLA models need an MLA backend" in out  # the rejected candidates are explained


def test_resolve_json_plan(capsys, configs_dir, global_test_plugins):
    code, out, _ = run(capsys, "resolve", "--json", "--model-path",
                       config(configs_dir, "gpt-oss-20b"), "--device-profile", "h200")
    assert code == 0  # the plan is made, and gpt_oss serves it (issue 35)
    data = json.loads(out)
    assert data["plan"]["model_impl"] == "gpt_oss"
    plan = data["plan"]
    assert data["model"] == "GptOssForCausalLM"
    assert (plan["decode_attention"], plan["page_size"]) == ("sinks_like", 16)
    assert plan["device"]["name"] == "NVIDIA H200"
    # a refused candidate is in the JSON with its reasons (fused_moe_like lacks GPT-OSS's
    # SwiGLU)
    assert any(c["slot"] == "moe_runner" and c["name"] == "fused_moe_like" and not c["fits"]
               and any("swigluoai" in r for r in c["reasons"]) for c in plan["candidates"])


def test_resolve_forced_incompatible_exits_1_with_reasons(capsys, configs_dir,
                                                         global_test_plugins):
    code, out, _ = run(capsys, "resolve", "--model-path", config(configs_dir, "llama-3.1-8b"),
                       "--device-profile", "h100", "--attention-backend", "fa3_like",
                       "--kv-cache-dtype", "fp8_e5m2")
    assert code == 1
    assert "fp8_e5m2 KV cache not supported (supports bfloat16, float16, fp8_e4m3)" in out
    assert "backends that would fit: triton_like" in out
    code, out, _ = run(capsys, "resolve", "--json", "--model-path",
                       config(configs_dir, "llama-3.1-8b"), "--device-profile", "x86-cpu",
                       "--attention-backend", "amx_like")
    assert code == 1
    data = json.loads(out)
    assert "needs CPU feature amx_bf16 (device has avx2,fp16)" in data["reasons"]
    # cpu_c (its portable build: this profile lacks fma / f16c for the others) ranks first on
    # a CPU, then numba_cpu (needs numba: a test dependency); flex_attention (FlexAttention's
    # eager path) fits too, ranked below torch_native.
    assert data["would_fit"][:3] == ["cpu_c", "numba_cpu", "torch_native"]
    assert data["would_fit"].index("flex_attention") > 2


def test_resolve_unknown_backend_lists_registered_names(capsys, configs_dir, clean_plugin_env):
    code, out, _ = run(capsys, "resolve", "--model-path", config(configs_dir, "qwen3-8b"),
                       "--attention-backend", "flashinfer")
    assert code == 1
    assert "unknown attention backend 'flashinfer' (--attention-backend)" in out
    assert "registered attention backends: " in out and "torch_native" in out


@pytest.mark.parametrize("profile,backend", [("x86-cpu", "cpu_c_mla"),
                                             ("h200", "triton_mla")])
def test_resolve_mla_with_builtins(capsys, configs_dir, clean_plugin_env, profile, backend):
    """A built-in MLA backend serves DeepSeek-V2-Lite (on a CPU a cpu_c_mla build; on the GPU
    triton_mla, above the reference torch_native_mla); the per-head backends are refused with
    the reason."""
    code, out, _ = run(capsys, "resolve", "--model-path", config(configs_dir, "deepseek-v2-lite"),
                       "--device-profile", profile)
    assert code == 0, out
    assert f"prefill attention  {backend}" in out
    assert f"decode attention   {backend}" in out
    assert "model impl         deepseek_v2" in out
    assert "MLA models need an MLA backend" in out  # torch_native and the others, refused


def test_resolve_default_model(capsys, clean_plugin_env):
    code, out, _ = run(capsys, "resolve")
    assert code == 0, out
    assert "model: LlamaForCausalLM" in out and "SmolLM2" in out


@pytest.mark.parametrize("argv,message", [
    (("--model-path", "/nonexistent/model"), "--model-path /nonexistent/model"),
    (("--device-profile", "no-such-gpu"), "unknown device profile 'no-such-gpu'"),
    (("--page-size", "0"), "--page-size must be >= 1"),
    (("--device", "tpu"), "unknown device 'tpu'"),
])
def test_resolve_usage_errors_exit_2_in_one_line(capsys, configs_dir, clean_plugin_env, argv,
                                                 message):
    if "--model-path" not in argv:
        argv = ("--model-path", config(configs_dir, "llama-3.1-8b"), *argv)
    code, out, err = run(capsys, "resolve", *argv)
    assert code == 2
    assert err.startswith("core resolve: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_flag_and_grouped_help(capsys):
    code, _, err = run(capsys, "resolve", "--attention-backnd", "x")
    assert code == 2 and "unrecognized arguments: --attention-backnd" in err
    code, out, _ = run(capsys, "resolve", "--help")
    assert code == 0
    for title in ("model and tokenizer:", "kernels and devices:", "memory and scheduling:"):
        assert title in out
    assert "--attention-backend" in out and "--prefill-attention-backend" in out
    assert "HTTP server:" not in out  # resolve takes no HTTP flags
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0 and "HTTP server:" in out and "--config" in out
    code, _, _ = run(capsys)
    assert code == 2  # a command is required


# ---------------------------------------------------------------------- serve and generate

def _fake_module(monkeypatch, name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_serve_dispatches_with_yaml_overridden_by_flags(capsys, monkeypatch, tmp_path):
    seen = {}

    def serve_main(args):
        seen["args"] = args
        return 0

    _fake_module(monkeypatch, "core.server", serve_main=serve_main)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 31000\ndtype: float16\nmax-running-requests: 7\n")
    code, _, _ = run(capsys, "serve", "--config", str(cfg), "--port", "32000")
    assert code == 0
    args = seen["args"]
    assert (args.port, args.dtype, args.max_running_requests) == (32000, "float16", 7)


def test_serve_bad_config_is_a_usage_error(capsys, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("no_such_flag: 1\n")
    code, _, err = run(capsys, "serve", "--config", str(cfg))
    assert code == 2 and "unknown argument(s): no_such_flag" in err
    code, _, err = run(capsys, "serve", "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err


def test_generate_dispatches_prompts_and_args(capsys, monkeypatch):
    seen = {}

    def generate_main(args, ns):
        seen.update(args=args, ns=ns)
        return 5

    _fake_module(monkeypatch, "core.entrypoints", generate_main=generate_main)
    code, _, _ = run(capsys, "generate", "hello", "world", "--max-new-tokens", "3",
                     "--temperature", "0.5", "--dtype", "float32")
    assert code == 5
    assert seen["ns"].prompts == ["hello", "world"]
    assert (seen["ns"].max_new_tokens, seen["ns"].temperature) == (3, 0.5)
    assert seen["args"].dtype == "float32"
    code, _, err = run(capsys, "generate", "x", "--max-new-tokens", "0")
    assert code == 2 and "--max-new-tokens must be >= 1" in err


def test_engine_missing_is_reported(capsys, monkeypatch):
    # A module that is not importable reads as "not available yet", with exit code 2.
    monkeypatch.setitem(sys.modules, "core.entrypoints", None)
    code, _, err = run(capsys, "generate", "hello")
    assert code == 2
    assert "core generate: the engine is not available yet in this version" in err


# ------------------------------------------------------- issue 32: caps, tool parser, wording

def test_backends_json_gives_every_field_of_every_plugins_caps(capsys, clean_plugin_env):
    """Structured caps, not only the summary string: every dataclass field of each plugin's
    caps, as JSON values; MoE runners' expert_parallel among them (and in the summary)."""
    import dataclasses

    from core.contract.capabilities import KINDS
    from core.plan.registry import get_registry

    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0
    rows = {(p["kind"], p["name"]): p for p in json.loads(out)["plugins"]}
    registry = get_registry()
    for kind in KINDS:
        for name, reg in registry.kind(kind).items():
            caps = rows[(kind, name)]["caps"]
            assert set(caps) == {f.name for f in dataclasses.fields(reg.caps)}, (kind, name)
    moe = rows[("moe", "torch_native")]
    assert moe["caps"]["expert_parallel"] is True and "expert_parallel" in moe["summary"]
    assert moe["caps"]["activations"] == sorted(moe["caps"]["activations"])  # sets: sorted lists
    attn = rows[("attention", "torch_native")]["caps"]
    assert isinstance(attn["page_sizes"], dict) and "mode" in attn["page_sizes"]
    code, out, _ = run(capsys, "backends")
    assert "expert_parallel" in out


def test_resolve_chooses_the_tool_call_parser_from_the_chat_template(capsys, clean_plugin_env):
    """`core resolve` shows the tool-call parser row, chosen as the server chooses it (from the
    model's chat template, read without loading the tokenizer), and takes --tool-call-parser."""
    code, out, _ = run(capsys, "resolve")
    assert code == 0, out
    assert "tool-call parser   hermes" in out
    assert "chat template (for the tool-call parser): the GGUF file's tokenizer.chat_template" \
        in out
    assert "tool-call parser:\n  * hermes" in out  # its candidates table
    code, out, _ = run(capsys, "resolve", "--tool-call-parser", "llama3_json")
    assert code == 0 and "tool-call parser   llama3" in out
    assert "the chat template shows none of its markers" in out
    code, out, _ = run(capsys, "resolve", "--tool-call-parser", "none")
    assert code == 0 and "tool-call parser   - (auto tool calls off)" in out
    code, out, _ = run(capsys, "resolve", "--tool-call-parser", "nope")
    assert code == 1 and "unknown tool-call parser 'nope' (--tool-call-parser)" in out
    code, out, _ = run(capsys, "resolve", "--json", "--tool-call-parser", "llama3")
    assert code == 0 and json.loads(out)["plan"]["tool_call_parser"] == "llama3"
    code, out, _ = run(capsys, "resolve", "--help")
    assert "--tool-call-parser" in out and "--chat-template" in out


def test_resolve_reads_a_chat_template_beside_the_config(capsys, configs_dir, tmp_path,
                                                         clean_plugin_env):
    import shutil as sh

    sh.copy(config(configs_dir, "llama-3.1-8b"), tmp_path / "config.json")
    code, out, _ = run(capsys, "resolve", "--model-path", str(tmp_path))
    assert code == 0 and "no chat template beside" in out
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages }}<|python_tag|>{{ tools }}"}))
    code, out, _ = run(capsys, "resolve", "--model-path", str(tmp_path))
    assert code == 0 and "tool-call parser   llama3" in out, out
    assert "the chat template holds its markup (<|python_tag|>)" in out
    template = tmp_path / "t.jinja"
    template.write_text("<tool_call>{{ tools }}")
    code, out, _ = run(capsys, "resolve", "--model-path", str(tmp_path), "--chat-template",
                       str(template))
    assert code == 0 and "tool-call parser   hermes" in out
    assert f"chat template (for the tool-call parser): --chat-template {template}" in out


def test_resolve_puts_what_the_config_leaves_out_under_a_heading(capsys, clean_plugin_env):
    """It opened with "not read from the config: architectures missing: ...", which reads like
    an error: those are assumptions, listed after the notes under their own heading."""
    code, out, _ = run(capsys, "resolve")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("model: LlamaForCausalLM") and lines[1] == "Plan:"
    assert "not read from the config" not in out
    heading = "Assumed (the model's config does not say; not an error):"
    assert out.index("Notes:") < out.index(heading) < out.index("Candidates (* = chosen):")
    assert "  - architectures missing: LlamaForCausalLM" in out
    code, out, _ = run(capsys, "resolve", "--json")
    assert any(a.startswith("architectures missing") for a in json.loads(out)["assumed"])


def test_serve_asks_the_worker_for_start_up_progress(capsys, monkeypatch):
    from core.cli import STARTUP_PROGRESS_ENV
    from core.engine.worker import STARTUP_PROGRESS_ENV as WORKER_ENV

    assert STARTUP_PROGRESS_ENV == WORKER_ENV
    seen = {}
    _fake_module(monkeypatch, "core.server", serve_main=lambda args: seen.update(
        env=os.environ.get(WORKER_ENV)))
    monkeypatch.setenv(WORKER_ENV, "")  # restored (unset) afterwards: cli sets it in-process
    monkeypatch.delenv(WORKER_ENV)
    assert run(capsys, "serve")[0] == 0 and seen["env"] == "1"
    seen.clear()
    monkeypatch.setenv(WORKER_ENV, "0")  # the user's choice stands
    assert run(capsys, "serve")[0] == 0 and seen["env"] == "0"


def test_worker_reports_each_start_up_phase(tmp_path, monkeypatch, capsys):
    """The four phases (and the load) each report as they end, with their seconds; the worker
    prints them to its stderr when STARTUP_PROGRESS_ENV asks (`core serve`)."""
    from model_fixtures import write_tiny_model

    from core.engine.worker import (
        STARTUP_PROGRESS_ENV,
        _progress_printer,
        build_engine_core,
        make_plan,
    )
    from core.plan.args import make_server_args

    path = str(write_tiny_model("llama", tmp_path / "llama"))
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=path, dtype="float32", max_total_tokens=256))
    lines: list[str] = []
    build_engine_core(args, plan, spec, registry, progress=lines.append)
    want = ["weights loaded", "memory planned: KV cache 256 tokens", "KV cache allocated",
            "model runner ready", "scheduler ready"]
    assert len(lines) == len(want), lines
    for line, start in zip(lines, want, strict=True):
        assert line.startswith(start) and line.endswith(" s)"), lines
    monkeypatch.delenv(STARTUP_PROGRESS_ENV, raising=False)
    assert _progress_printer(args) is None
    monkeypatch.setenv(STARTUP_PROGRESS_ENV, "1")
    capsys.readouterr()
    _progress_printer(args)("scheduler ready (0.0 s)")
    assert capsys.readouterr().err == "core: engine: scheduler ready (0.0 s)\n"


class _FakeEngine:
    """What generate_main uses of core.frontend.offline.Engine."""

    def __init__(self, server_args):
        from core.plan.devices import PROFILES
        from core.plan.model_spec import load_model_spec
        from core.plan.registry import get_registry
        from core.plan.resolver import resolve

        spec = load_model_spec(str(Path(__file__).parent / "fixtures" / "configs" /
                                   "llama-3.1-8b.json"))
        self.plan = resolve(spec, PROFILES["x86-cpu"], server_args, get_registry())
        from core.messages import EngineInfo

        self.info = EngineInfo(max_context=8192, pool_tokens=32768, page_size=1,
                               max_running_requests=8, vocab_size=128256, eos_token_ids=(2,),
                               chunked_prefill_size=None, kv_bytes_per_token=64,
                               notes=("KV cache 32768 tokens, the default",),
                               cuda_graph_batch_sizes=(), device="cpu", pid=1)
        self.tokenizer = types.SimpleNamespace(chat_template=None, encode=lambda p: [1, 2])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, input_ids, sampling_params):
        return [{"text": "Paris."} for _ in input_ids]


def test_generate_prints_a_one_line_plan_unless_verbose(capsys, monkeypatch, clean_plugin_env):
    from core.frontend import offline

    monkeypatch.setattr(offline, "Engine", _FakeEngine)
    monkeypatch.setenv("CORE_STARTUP_PROGRESS", "")  # restored (unset) afterwards
    monkeypatch.delenv("CORE_STARTUP_PROGRESS")
    code, out, err = run(capsys, "generate", "What is the capital of France?")
    assert code == 0 and out == "Paris.\n"
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("core generate: llama on cpu") and "KV cache 32768 tokens" in err
    assert "--verbose" in err and "CORE_STARTUP_PROGRESS" not in os.environ
    code, out, err = run(capsys, "generate", "--verbose", "What is the capital of France?")
    assert code == 0 and out == "Paris.\n"
    assert "Plan:" in err and "Candidates (* = chosen):" in err
    assert "  - KV cache 32768 tokens, the default" in err
    assert os.environ.get("CORE_STARTUP_PROGRESS") == "1"  # the worker's phases too
