"""What the kernel tests (test_kernels_*.py, test_attention.py) share: float32 / float64 arenas with named
regions and garbage-filled guard gaps (a kernel must write nothing outside its outputs), tape rows, the
tolerance check, random values rounded to the dtype, central finite differences, and the float64 numpy
references more than one file checks against (causal attention forward and backward, tanh GELU)."""
import numpy as np


DTS = [np.float32, np.float64]
GARBAGE = 777.25


def tol(dt):
    return 1e-5 if dt == np.float32 else 1e-10


def check(got, ref, dt, t=None):
    """max |got - ref| <= tol * max(1, max|ref|)"""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    lim = (tol(dt) if t is None else t) * max(1.0, float(np.abs(ref).max(initial=0.0)))
    err = float(np.abs(got - ref).max(initial=0.0))
    assert err <= lim, f"max abs err {err:.3e} > {lim:.3e}"


def rnd(rng, shape, dt, scale=1.0):
    """random normal values already rounded to dt (so the float64 reference sees the stored values)"""
    return (rng.standard_normal(shape) * scale).astype(dt).astype(np.float64)


class Arena:
    """Float arena with named regions (16-aligned, 16-float guard gaps pre-filled with garbage)."""

    def __init__(self, dt):
        self.dt, self.regions, self.n = dt, {}, 16

    def put(self, name, x=None, size=None):
        size = int(np.size(x)) if x is not None else int(size)
        self.regions[name] = (self.n, size, x)
        self.n += (size + 15) // 16 * 16 + 16
        return self.regions[name][0]

    def build(self):
        self.a = np.full(self.n + 16, GARBAGE, self.dt)
        for o, size, x in self.regions.values():
            if x is not None:
                self.a[o:o + size] = np.ravel(x)
        self.before = self.a.copy()
        return self.a

    def get(self, name, shape=None):
        o, size, _ = self.regions[name]
        v = self.a[o:o + size].astype(np.float64)
        return v.reshape(shape) if shape is not None else v

    def only_wrote(self, *names):
        mask = np.ones(self.a.size, bool)
        for nm in names:
            o, size, _ = self.regions[nm]
            mask[o:o + size] = False
        assert np.array_equal(self.a[mask], self.before[mask]), "kernel wrote outside its outputs"


def row(*args):
    """A tape row as the lowering makes them: opcode slot, args, zero-padded to ROW."""
    from btjit.kernels.common import ROW
    return np.array([0, *args] + [0] * (ROW - 1 - len(args)), np.int64)


def fd_grad(f, x, eps=1e-6):
    """central finite-difference gradient of scalar f at x (float64)"""
    g = np.zeros_like(x)
    for i in range(x.size):
        xp = x.copy(); xp.flat[i] += eps
        xm = x.copy(); xm.flat[i] -= eps
        g.flat[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


def attn_ref(qkv, B, T, C, NH, scale):
    hs = C // NH
    x = qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)         # (3, B, NH, T, hs)
    q, k, v = x[0], x[1], x[2]
    S = q @ k.transpose(0, 1, 3, 2) * scale
    S = np.where(np.tril(np.ones((T, T), bool)), S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    y = (P @ v).transpose(0, 2, 1, 3).reshape(B * T, C)
    return y, P.reshape(B * NH * T, T)


def attn_bwd_ref(qkv, dy, B, T, C, NH, scale):
    hs = C // NH
    x = qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    q, k, v = x[0], x[1], x[2]
    P = attn_ref(qkv, B, T, C, NH, scale)[1].reshape(B, NH, T, T)
    dY = dy.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    dv = P.transpose(0, 1, 3, 2) @ dY
    dP = dY @ v.transpose(0, 1, 3, 2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True)) * scale
    dq, dk = dS @ k, dS.transpose(0, 1, 3, 2) @ q
    return np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B * T, 3 * C)


def gelu_ref(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
