"""Test kits for backend authors: the attention-backend conformance suite, as a pytest plugin.

A package that ships an attention backend (registered through the `core.plugins` entry point)
checks it against the contract and the `torch_native` reference with one option:

    pytest --conformance-backend my_backend
    pytest --conformance-backend my_backend --conformance-device cuda -m gpu --conformance-full

The plugin (`core.testing.conformance`) is installed as a `pytest11` entry point and stays inert
without that option. A package can make it its default, so that a plain `pytest` runs the suite
(naming the backend again on the command line is harmless):

    [tool.pytest.ini_options]
    addopts = "--conformance-backend my_backend"

Only what the backend declares is run; each thing it does not declare (a page size, a dtype, a
feature) is one skipped test with the reason (`pytest -rs` lists them). Where core-serve is importable but not installed, load it by hand:

    pytest -p core.testing.conformance --backend my_backend

Or import the tests into a test module of your own (they parametrize themselves over every
registered backend runnable here, or the ones named by --conformance-backend):

    from core.testing.attention_suite import *  # noqa: F401,F403

Modules: `paged_batch` (random poisoned paged batches), `attention_reference` (the fp32 ground
truth), `attention_cases` (the case matrix cut to a backend's capabilities), `attention_check`
(run one case, check output / KV write / untouched pool), `attention_suite` (the pytest tests),
`conformance` (the pytest plugin).
"""
