# btjit/bench -- `btjit bench`: the paper's workloads E1..E6 (workloads.py), the peers PyTorch / JAX /
# micrograd / autograd (peers/), the btjit runner (btjit_impl.py, by the lead), and the harness that
# measures each (workload, impl) in its own subprocess (run_one.py) and tabulates them (harness.py).
# Nothing here is imported by the btjit core; the names below load lazily so `python -m
# btjit.bench.run_one` imports no framework (and not numpy) before it has set the thread env vars.
__all__ = ["run_bench", "format_table", "machine_info", "measure"]


def __getattr__(name):
    if name in __all__:
        from btjit.bench import harness
        return getattr(harness, name)
    raise AttributeError(f"module 'btjit.bench' has no attribute {name!r}")
