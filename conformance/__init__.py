"""Conformance kits for plugin authors: one pytest suite per plugin kind, and the pytest plugin
that runs them. Shipped with core-serve as its own top-level package (it was `core.testing` until
0.1; that name stays an alias until 0.2) because it is a test kit, not part of the serving core:
core never imports it.

A package that ships an attention backend (registered through the `core.plugins` entry point)
checks it against the contract and the `torch_native` reference with one option:

    pytest --conformance-backend my_backend
    pytest --conformance-backend my_backend --conformance-device cuda -m gpu --conformance-full

The plugin (`conformance.plugin`) is installed as a `pytest11` entry point and stays inert
without that option. A package can make it its default, so that a plain `pytest` runs the suite
(naming the backend again on the command line is harmless):

    [tool.pytest.ini_options]
    addopts = "--conformance-backend my_backend"

Only what the backend declares is run; each thing it does not declare (a page size, a dtype, a
feature) is one skipped test with the reason (`pytest -rs` lists them). Where core-serve is
importable but not installed, load the plugin by hand:

    pytest -p conformance.plugin --backend my_backend

Or import the tests into a test module of your own (they parametrize themselves over every
registered backend runnable here, or the ones named by --conformance-backend):

    from conformance.attention_suite import *  # noqa: F401,F403

Modules: `paged_batch` (random poisoned paged batches), `attention_reference` (the fp32 ground
truth), `attention_cases` (the case matrix cut to a backend's capabilities), `attention_check`
(run one case, check output / KV write / untouched pool), `attention_suite` (the pytest tests);
`mla_suite` (the MLA kind, core.contract.mla: fp32/fp16/bf16 cases with a reference of both
forms); `moe_cases`, `moe_check`, `moe_suite` the same for MoE runners; `layer_ops_suite`,
`quant_suite` (with `quant_refs`, `quant_refs_int4`), `grammar_suite`, `tool_parser_suite`,
`platform_suite` one suite per kind; `suite_kit` (what the device-bound suites share when
they parametrize: suite devices, selected plugins that can run there, the skips saying
why one does not); `model_configs` (small model configs the tests share);
`plugin` (the pytest plugin, whose options add a suite to a run; named `plugin` rather than
`conformance` so that `-p conformance.plugin` says what it loads).
"""
