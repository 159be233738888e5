"""core-example-backend: a third-party core-serve plugin, as a kernel author would ship one.

It registers two things through the `core.plugins` entry point named `example`:

- attention backend `example_sdpa`: torch's scaled_dot_product_attention per request over the
  paged KV cache. Its capabilities are deliberately narrower than the built-in `torch_native`
  (head sizes 64/128 only, page size 16 only, no sliding window, no logit soft-cap), so the
  resolver has something to reject and explain.
- hardware target `example_accel`: a teaching accelerator (the host CPU under another name) with
  a Platform of its own, so the engine serves on it end to end.

Importing this module imports no kernel library and not even torch: the classes live in
`backend.py` and `accel.py`, named by "module:attr" strings the core resolves only when chosen.
"""

from core.contract.capabilities import AttentionCaps, HardwareCaps, PageSizes
from core.contract.hookspecs import hookimpl

# The core plugin API versions this package was written against (PEP 440 specifier). A core
# outside this range rejects the plugin with a clear reason instead of crashing later.
CORE_PLUGIN_API = ">=1.8,<2"  # 1.8: its Platform subclasses BasePlatform

ATTENTION_CAPS = AttentionCaps(
    devices={"cpu", "cuda", "example_accel"},
    dtypes={"float32", "float16", "bfloat16"},
    kv_cache_dtypes={"float32", "float16", "bfloat16"},
    head_sizes={64, 128},
    # One page size only: when the user leaves --page-size open the plan adopts 16 and says so.
    page_sizes=PageSizes.of(16),
    attention_kinds={"MHA", "GQA", "MQA"},
    sliding_window=False,
    logit_softcap=False,
    sinks=False,
    phases={"prefill", "decode"},
    # A Python loop over requests cannot be captured in a CUDA graph.
    cuda_graph=False,
    # Below torch_native (cpu 10, cuda 1), so it is used only when asked for by name; first
    # choice on the example accelerator, which torch_native does not declare.
    priority={"cpu": 5, "cuda": 0, "example_accel": 10},
    description="example third-party backend: torch SDPA per request over the paged KV cache",
)

ACCEL_CAPS = HardwareCaps(
    device_type="cpu",  # it runs on the host CPU; there is no real accelerator behind it
    vendor="Example",
    dist_backend="gloo",
    description="teaching accelerator (runs on the host CPU, a Platform of its own); "
                "available only with CORE_EXAMPLE_ACCEL=1",
    # Below the built-in cpu target, so it never wins when --device is left open.
    priority=-10,
)


@hookimpl
def core_register_attention_backends(register):
    register("example_sdpa", ATTENTION_CAPS, "core_example_backend.backend:ExampleSDPAAttention")


@hookimpl
def core_register_hardware(register):
    register("example_accel", ACCEL_CAPS, "core_example_backend.accel:probe",
             platform="core_example_backend.accel:ExampleAccelPlatform")
