# btjit/bench/peers/micrograd_peer.py -- Karpathy's micrograd (pip `micrograd`, engine.Value) as a peer for
# E1..E4. Every step builds the graph from fresh Values and calls backward() (micrograd has no other mode;
# the topological sort is redone each step). micrograd's ReLU backward is 1[out>0], so its E2 gradients are
# the correct 138.8338 / 645.5773. E3/E4: micrograd has no serialization; its node values are Python
# floats, so the honest equivalent is json.dump / json.load of {name: value.data} (note says so).
# E5/E6 are not benchmarked (a 1M-parameter scalar graph per step is out of reach for micrograd).
import json
import os
import tempfile

from micrograd.engine import Value

from btjit.bench import workloads as W
from btjit.bench.peers import NotApplicable, Runner


class ScalarRunner(Runner):
    note = "graph rebuilt + topo sort every step (micrograd's only mode)"

    def __init__(self, workload_id):
        s = W.WORKLOADS[workload_id].settings
        self.av, self.bv = s["a"], s["b"]
        self.fn = W.e1 if workload_id == "E1" else (lambda a, b: W.e2(a, b, Value.relu))

    def _run(self):
        a, b = Value(self.av), Value(self.bv)
        g = self.fn(a, b)
        g.backward()
        return g, a, b

    def step(self):
        return self._run()[0]

    def check(self):
        g, a, b = self._run()
        return dict(g=g.data, dg_da=a.grad, dg_db=b.grad)


class IORunner(Runner):
    note = "json of {name: Value.data} (micrograd has no save/load)"

    def __init__(self, workload_id):
        self._dir = tempfile.TemporaryDirectory(prefix="btjit_bench_")
        self.path = os.path.join(self._dir.name, "e2_nodes.json")
        nodes = W.e2_nodes(Value(-4.0), Value(2.0), Value.relu)
        self.nodes = nodes
        self.save()
        self.step = self.save if workload_id == "E3" else self.load

    def save(self):
        with open(self.path, "w") as f:
            json.dump({k: v.data for k, v in self.nodes.items()}, f)

    def load(self):
        with open(self.path) as f:
            return {k: Value(v) for k, v in json.load(f).items()}

    def check(self):
        self.save()
        return {k: v.data for k, v in self.load().items()}


def make(workload_id, **_ignored):
    kind = W.WORKLOADS[workload_id].kind
    if kind == "scalar":
        return ScalarRunner(workload_id)
    if kind == "io":
        return IORunner(workload_id)
    raise NotApplicable("micrograd is a scalar engine; E5/E6 are not run with it")
