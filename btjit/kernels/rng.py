"""Counter-based random numbers inside the kernels: Philox-4x32-10 (Salmon et al., SC'11; Random123).

Every random number is a pure function of (the program's seed, the step count, the site, the element index):
no generator state but the step counter the int arena already holds. The key block at ia[okey:] is
[step, (the index-check flag), seed low 32 bits, seed high 32 bits, replica] (the plan's int_state slots,
btjit/graph/memory.py); the Philox key is the seed, the counter (element index low 32 bits, element index
high 32 bits, site, step). Replica r of a data-parallel program (trace(..., replicas=R), each replica traced
on its shard of the batch) numbers its elements from r * (the op's size): for an op whose first axis is the
batch's -- every dropout of a model whose loss is a mean over the batch -- those are the elements' indices in
the whole batch, so the replicas draw exactly the numbers one program on the whole batch draws.
A site is one random op of the traced function (numbered in trace order); the element index is the C-order
position in that op's output, so a kernel split over threads or rows, the fused chain interpreter
(btjit/kernels/fused.py), the standalone k_rand row and the attention kernels all draw the same number for
the same element.

uniform: element e's number is word e % 4 of the Philox block of counter (e // 4 low and high 32 bits, site,
step) -- four numbers a call, as Random123 and torch's Philox use them -- its top 24 bits times 2^-24, in [0, 1),
exact in float32 and float64 (the same masks in both). normal: Box-Muller on the first two words of element
e's own block (counter (e low, e high, site, step)). `philox_np` is the numpy reference.
"""
import math

import numpy as np
from numba import njit

from btjit.kernels.common import FM, cvt, row

KEY_STEP, KEY_SEED, KEY_REPLICA, KEY_SIZE = 0, 2, 4, 5   # the key block's slots (module docstring)
U_UNIFORM, U_NORMAL = 0, 1
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)
_S32, _S8, _S2 = np.uint64(32), np.uint64(8), np.uint64(2)
_TWO_PI = 6.283185307179586


@njit(**FM)     # not inline="always": numba's IR copier made ten copies per caller (~1 s of compile); LLVM inlines it
def _round(c0, c1, c2, c3, k0, k1):
    p0 = c0 * _M0
    p1 = c2 * _M1
    return (p1 >> _S32) ^ c1 ^ k0, p1 & _LO, (p0 >> _S32) ^ c3 ^ k1, p0 & _LO, (k0 + _W0) & _LO, (k1 + _W1) & _LO


@njit(inline="always", **FM)
def philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1): uint64s holding 32-bit words.
    The ten rounds written out (a loop over them keeps LLVM from vectorizing the caller's loop)."""
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    c0, c1, c2, c3, k0, k1 = _round(c0, c1, c2, c3, k0, k1)
    return c0, c1, c2, c3


@njit(inline="always", **FM)
def key(ia, okey, site):
    """(k0, k1, c2, c3): the Philox key and the counter's site and step words from the key block at ia[okey:]."""
    k0 = np.uint64(np.uint32(ia[okey + KEY_SEED]))
    k1 = np.uint64(np.uint32(ia[okey + KEY_SEED + 1]))
    return k0, k1, np.uint64(np.uint32(site)), np.uint64(np.uint32(ia[okey + KEY_STEP]))


@njit(inline="always", **FM)
def first(ia, okey, size):
    """The index of an op's first element (size elements per replica): replica * size."""
    return np.int64(ia[okey + KEY_REPLICA]) * size


@njit(inline="always", **FM)
def _unit(d, w):
    """A 32-bit word's top 24 bits times 2^-24, in d's dtype."""
    return cvt(d, np.int32(w >> _S8)) * cvt(d, 5.9604644775390625e-08)     # 2^-24


@njit(inline="always", **FM)
def uniform_at(d, e, k0, k1, c2, c3):
    """The uniform number of element e (int64) in d's dtype: word e % 4 of the block of e // 4."""
    q = np.uint64(e) >> _S2
    w0, w1, w2, w3 = philox(q & _LO, q >> _S32, c2, c3, k0, k1)
    k = e & 3
    return _unit(d, w0 if k == 0 else w1 if k == 1 else w2 if k == 2 else w3)


@njit(**FM)
def fill(d, m, e0, kind, k0, k1, c2, c3):
    """d[j] = the random number (kind U_UNIFORM or U_NORMAL) of element e0 + j, for j < m. Uniform: one Philox
    block gives the four numbers of elements 4q .. 4q+3 (its four words)."""
    if kind == U_UNIFORM:
        h = min(m, (4 - e0 % 4) % 4)            # up to the first element of a block
        for j in range(h):
            d[j] = uniform_at(d, e0 + j, k0, k1, c2, c3)
        nq = (m - h) // 4
        q0 = (e0 + h) // 4
        s = d[h:h + 4 * nq]
        for t in range(nq):                     # whole blocks: four numbers a Philox call (the loop vectorizes)
            q = np.uint64(q0 + t)
            w0, w1, w2, w3 = philox(q & _LO, q >> _S32, c2, c3, k0, k1)
            s[4 * t] = _unit(d, w0)
            s[4 * t + 1] = _unit(d, w1)
            s[4 * t + 2] = _unit(d, w2)
            s[4 * t + 3] = _unit(d, w3)
        for j in range(h + 4 * nq, m):
            d[j] = uniform_at(d, e0 + j, k0, k1, c2, c3)
        return
    sc = cvt(d, 5.9604644775390625e-08)
    for j in range(m):
        ue = np.uint64(e0 + j)
        w0, w1, _, _ = philox(ue & _LO, ue >> _S32, c2, c3, k0, k1)
        u1 = (cvt(d, np.int32(w0 >> _S8)) + cvt(d, 1.0)) * sc          # (0, 1]: the log is finite
        u2 = cvt(d, np.int32(w1 >> _S8)) * sc
        d[j] = math.sqrt(cvt(d, -2.0) * math.log(u1)) * math.cos(cvt(d, _TWO_PI) * u2)


@row("oout n okey site kind")
@njit(**FM)
def k_rand(a, ia, r):
    """a[oout:oout+n] = the random numbers (kind: U_UNIFORM / U_NORMAL) of site `site`, its n elements,
    under the key block at ia[okey:]."""
    oout = r[1]; n = r[2]; okey = r[3]; site = r[4]; kind = r[5]
    k0, k1, c2, c3 = key(ia, okey, site)
    fill(a[oout:oout + n], n, first(ia, okey, n), kind, k0, k1, c2, c3)


@row("ostep ofrom")
@njit(**FM)
def k_step_set(a, ia, r):
    """ia[ostep] = a[ofrom]: the random numbers' step count set, when the step ends, from the optimizer's step
    slot (a float hyper-parameter, which a skipped step leaves as it was)."""
    ostep, ofrom = r[1], r[2]
    ia[ostep] = np.int32(a[ofrom])


# ----------------------------------------------------------------------------- the numpy reference
def philox_np(counter, k0, k1):
    """Philox-4x32-10 over arrays: counter a tuple of 4 uint64 arrays of 32-bit words; returns 4 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in counter)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0, p1 = c0 * _M0, c2 * _M1
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _LO, (p0 >> _S32) ^ c3 ^ k1, p0 & _LO
        k0, k1 = (k0 + _W0) & _LO, (k1 + _W1) & _LO
    return c0, c1, c2, c3


def random_np(shape, kind, site, key_block, dtype=np.float64):
    """The numbers k_rand writes for an output of `shape` (element indices 0 .. size-1) under key_block."""
    n = int(np.prod(shape))
    e = np.arange(n, dtype=np.uint64) + np.uint64(int(key_block[KEY_REPLICA]) * n)
    w32 = [int(np.uint32(np.int32(x))) for x in key_block]

    def words(c):
        return philox_np((c & _LO, c >> _S32, np.full_like(c, site), np.full_like(c, w32[KEY_STEP])),
                         w32[KEY_SEED], w32[KEY_SEED + 1])
    sc = 2.0 ** -24
    if kind == U_NORMAL:
        w = words(e)
        u1 = ((w[0] >> _S8).astype(np.float64) + 1.0) * sc
        u = np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * (w[1] >> _S8).astype(np.float64) * sc)
    else:
        w = np.stack(words(e >> np.uint64(2)))[(e & np.uint64(3)).astype(np.int64), np.arange(n)]
        u = (w >> _S8).astype(np.float64) * sc
    return u.astype(dtype).reshape(shape)


def seed_words(seed: int) -> tuple:
    """The seed as the two int32 words of the key block (any Python int; its low 64 bits)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.int32(np.uint32(s & 0xFFFFFFFF)), np.int32(np.uint32(s >> 32))
