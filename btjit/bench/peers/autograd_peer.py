# btjit/bench/peers/autograd_peer.py -- HIPS autograd (pip `autograd`) as a peer for E1/E2: value_and_grad
# over both arguments, float64 Python scalars. autograd traces every call (it has no compile step), so one
# step = trace + forward + reverse sweep. relu is autograd.numpy.maximum(x, 0.0) (no ties at E2's points).
# E3/E4 are n/a (autograd has no save/load; it would be plain numpy), E5/E6 are not benchmarked.
import autograd.numpy as anp
from autograd import value_and_grad

from btjit.bench import workloads as W
from btjit.bench.peers import NA_IO, NotApplicable, Runner


def _relu(x):
    return anp.maximum(x, 0.0)


class ScalarRunner(Runner):
    note = "value_and_grad traced every call"

    def __init__(self, workload_id):
        s = W.WORKLOADS[workload_id].settings
        self.a, self.b = s["a"], s["b"]
        fn = W.e1 if workload_id == "E1" else (lambda a, b: W.e2(a, b, _relu))
        self.vg = value_and_grad(fn, argnum=(0, 1))

    def step(self):
        return self.vg(self.a, self.b)

    def check(self):
        g, (ga, gb) = self.vg(self.a, self.b)
        return dict(g=float(g), dg_da=float(ga), dg_db=float(gb))


def make(workload_id, **_ignored):
    kind = W.WORKLOADS[workload_id].kind
    if kind == "scalar":
        return ScalarRunner(workload_id)
    if kind == "io":
        raise NotApplicable(NA_IO)
    raise NotApplicable("autograd is not benchmarked on E5/E6")
