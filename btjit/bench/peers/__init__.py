# btjit/bench/peers/__init__.py -- the registry of benchmark implementations ("impls"): which module
# implements each, which pip package it needs, and which workloads it runs (or why a workload is "n/a").
# Importing this file imports no framework: the parent harness reads the table, the child (run_one.py)
# calls load(). Every impl module exposes `make(workload_id, **opts) -> Runner`:
#
#   opts: threads=1, seed=0, compile=False (torch only), anything else is ignored by peers.
#   Runner.step()            one iteration exactly as PAPER.md defines it; returns when the work is DONE
#                            (JAX blocks on its outputs). E1/E2 return g, E5/E6 return the loss (float).
#   Runner.compile_seconds   float or None: compile time measured apart from step time (jit/trace/compile).
#   Runner.check()           dict for a correctness smoke, computed at the current params without updating:
#                            E1/E2 {"g", "dg_da", "dg_db"}; E3/E4 {"a".."g"}; E5/E6 {"loss", "vocab"}.
#   Runner.data              "names.txt" | "tinyshakespeare.txt" | "generated" | None (E1..E4).
#   Runner.note              short free text for the table ("" if nothing to say).
#   optional Runner.params() dict name -> numpy array (E5/E6, names as in workloads.py).
#   optional Runner.run(n)   n steps in the impl's own (native) loop; the harness prefers it when present.
ALL = ("E1", "E2", "E3", "E4", "E5", "E6b1", "E6b64")
TRAIN = ("E5", "E6b1", "E6b64")
NA_IO = "no framework-specific save/load of 7 scalars (it would be numpy/json, not the peer)"

# impl name -> (module, pip package needed or None, {workload: True | "reason it is n/a"}, extra make() opts)
IMPLS = {
    "btjit": ("btjit.bench.btjit_impl", None, {w: True for w in ALL}, {}),
    "btjit.many": ("btjit.bench.btjit_scalar", None, {"E1": True, "E2": True}, {"many": True}),
    "torch": ("btjit.bench.peers.torch_peer", "torch", {w: True for w in ALL}, {}),
    "torch.compile": ("btjit.bench.peers.torch_peer", "torch", {w: True for w in TRAIN}, {"compile": True}),
    "torch.paper": ("btjit.bench.peers.torch_peer", "torch", {"E6b1": True, "E6b64": True}, {"paper": True}),
    "jax": ("btjit.bench.peers.jax_peer", "jax",
            {"E1": True, "E2": True, "E3": NA_IO, "E4": NA_IO, **{w: True for w in TRAIN}}, {}),
    "micrograd": ("btjit.bench.peers.micrograd_peer", "micrograd", {w: True for w in ALL[:4]}, {}),
    "autograd": ("btjit.bench.peers.autograd_peer", "autograd",
                 {"E1": True, "E2": True, "E3": NA_IO, "E4": NA_IO}, {}),
}
DEFAULT_PEERS = ("torch", "torch.paper", "jax", "micrograd", "autograd")


class NotApplicable(Exception):
    """Raised by make() when a workload is meaningless for an impl; the row says "n/a" with the reason."""


def supports(impl, workload_id):
    """True, "reason it is n/a" (str), or None (the pair is not benchmarked at all, no row)."""
    if impl not in IMPLS:
        return True                     # unknown impl: let run_one report "not installed"
    return IMPLS[impl][2].get(workload_id)


def load(impl):
    """-> (module, extra opts). Raises ModuleNotFoundError when the impl or its package is missing."""
    import importlib
    if impl not in IMPLS:
        raise ModuleNotFoundError(f"unknown impl {impl!r} (known: {', '.join(IMPLS)})", name=impl)
    module, _pkg, _w, extra = IMPLS[impl]
    return importlib.import_module(module), dict(extra)


def package_version(impl):
    from importlib import metadata
    if impl not in IMPLS:
        return None
    pkg = IMPLS[impl][1] or "btjit"
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


class Runner:
    """Defaults for the Runner attributes; subclasses set step/check (and maybe params/run)."""
    compile_seconds = None
    data = None
    note = ""

    def step(self):
        raise NotImplementedError

    def check(self):
        raise NotImplementedError
