"""The worker process: build phases and loop (worker), model runner, graphs, sampler, loader,
distributed group, scheduler, grammar compile processes, and memory/ (KV pool, pages, radix
cache). Never imports core.frontend or core.server (tested)."""
