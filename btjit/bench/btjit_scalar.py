# btjit/bench/btjit_scalar.py -- btjit's E1-E4 for `btjit bench`: the paper's scalar graphs through
# btjit.trace_scalar (traced once, compiled to straight-line native code, cached).
#   impl "btjit":      E1/E2 step = one Python call f(a, b) -> (value, grads); E3/E4 = one save / one load
#                      of the 7 named nodes a..g of E2 in btjit's node-value file format.
#   impl "btjit.many": E1/E2 run(n) = f.many over n input rows in ONE native loop; time per row. Its entry
#                      point is compiled in make() (outside the timing) and min_iters = CHUNK rows.
import os
import tempfile
import time

import numpy as np

import btjit
from btjit.scalar import nodefile
from btjit.bench import workloads as W
from btjit.bench.peers import Runner

CHUNK = 4096


def _fn(workload_id):
    if workload_id == "E1":
        return lambda a, b: W.e1(a, b)
    return lambda a, b: (W.e2(a, b, btjit.relu), W.e2_nodes(a, b, btjit.relu))


class ScalarRunner(Runner):
    def __init__(self, workload_id, many=False):
        s = W.WORKLOADS[workload_id].settings
        self.a, self.b = s["a"], s["b"]
        t0 = time.perf_counter()
        self.f = btjit.trace_scalar(_fn(workload_id), dtype="float64")
        self.f(self.a, self.b)                        # compile (or load from cache) now
        if many:
            self.note_many = f"; f.many over {CHUNK} rows per native call, time per row"
            self._X = np.tile(np.array([[self.a, self.b]]), (CHUNK, 1))
            self._out = (np.empty((CHUNK, 1)), np.empty((CHUNK, 2)))
            self.f.many(self._X, out=self._out)       # f.many is its own entry point: compile (or load) it now too
            self.run = self._run_many
            self.min_iters = CHUNK                    # run_one never times fewer rows than one native call
        self.compile_seconds = time.perf_counter() - t0
        self.note = f"{self.f.n_instructions} native instructions" + (self.note_many if many else "")

    def step(self):
        return self.f(self.a, self.b)[0]

    def _run_many(self, n):
        """n iterations = n rows, evaluated CHUNK rows per f.many call (bounded memory)."""
        for _ in range(n // CHUNK):
            self.f.many(self._X, out=self._out)
        r = n % CHUNK
        if r:
            self.f.many(self._X[:r], out=(self._out[0][:r], self._out[1][:r]))

    def check(self):
        v, (da, db) = self.f(self.a, self.b)
        return dict(g=v, dg_da=da, dg_db=db)


class IORunner(Runner):
    note = "btjit node-value file (header + names + float64 values + CRC-32)"

    def __init__(self, workload_id):
        self._dir = tempfile.TemporaryDirectory(prefix="btjit_bench_")
        self.path = os.path.join(self._dir.name, "e2_nodes.btv")
        f = btjit.trace_scalar(_fn("E2"), dtype="float64")
        s = W.WORKLOADS["E2"].settings
        self.values = f.values(s["a"], s["b"])
        self.save()
        self.step = self.save if workload_id == "E3" else self.load

    def save(self):
        nodefile.save_values(self.path, self.values)

    def load(self):
        return nodefile.load_values(self.path)

    def check(self):
        self.save()
        return dict(self.load())


def make(workload_id, many=False, **_ignored):
    kind = W.WORKLOADS[workload_id].kind
    if kind == "scalar":
        return ScalarRunner(workload_id, many=many)
    return IORunner(workload_id)
