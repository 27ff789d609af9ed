# btjit/compress.py -- compressed gradient communication for data-parallel training (btjit.train.distributed):
# TopK and RandK sparsification wrapped in EF21 error feedback (Richtarik, Sokolov, Fatkhullin, "EF21: A
# New, Simpler, Theoretically Better, and Practically Faster Error Feedback", NeurIPS 2021).
#
# EF21, per rank i with local gradient grad_i and the same k on every rank:
#     c_i   = C(grad_i - g_i)          C = TopK or RandK (a contractive compressor, no rescaling)
#     g_i  += c_i                      the rank's running estimate of its own gradient
#     g    += mean_i c_i               g = mean_i g_i, identical on every rank; the optimizer steps on g
# The first step sends the dense gradient (g_i = grad_i), so g starts exact. Only c_i travels:
#   TopK:  each rank picks its own k largest |entries|: (index, value) pairs, one Allgather of k*(4+itemsize)
#          bytes per rank; every rank then adds all N*k pairs in rank order (identical result everywhere).
#   RandK: the k indices come from a generator seeded by (seed, t), the same on every rank, so only the k
#          values travel, summed by one in-place Allreduce of k*itemsize bytes.
# A non-finite value anywhere leaves the EF21 state untouched and fills the gradient with NaN, so the
# trainer's non-finite handling (stop, or the native skip) sees it on every rank alike.
# MPI enters only through the `comm` argument (an mpi4py communicator); nothing here imports mpi4py.
from __future__ import annotations

import math

import numpy as np

KINDS = ("none", "topk", "randk")


def n_selected(ratio: float, n: int) -> int:
    """k = ceil(ratio * n), at least 1 and at most n."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return max(1, min(n, math.ceil(ratio * n)))


def topk_indices(d: np.ndarray, k: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """Indices (int32, ascending) of the k entries of d with the largest magnitude. Exact; fast for k << n:
    a threshold from a strided sample keeps ~2k candidates (if at least k entries reach it, the k-th largest
    does too, so every top-k entry is a candidate), then one argpartition over the candidates only."""
    a = np.abs(d, out=scratch) if scratch is not None else np.abs(d)
    n = a.size
    if k >= n:
        return np.arange(n, dtype=np.int32)
    idx = None
    if 8 * k < n:
        step = max(1, n // 4096)
        sample = a[::step]
        q = sample.size - min(sample.size, max(1, (2 * k * sample.size) // n))
        thr = np.partition(sample, q)[q]
        cand = np.flatnonzero(a >= thr)
        if cand.size >= k:
            idx = cand[np.argpartition(a[cand], cand.size - k)[cand.size - k:]]
    if idx is None:
        idx = np.argpartition(a, n - k)[n - k:]
    idx.sort()
    return idx.astype(np.int32, copy=False)


def randk_indices(candidates: np.ndarray, k: int, seed: int, t: int) -> np.ndarray:
    """k distinct entries of `candidates` (ascending), drawn by a generator seeded by (seed, t): every rank
    that calls this with the same arguments gets the same indices, so they need not be sent."""
    rng = np.random.default_rng([int(seed), int(t), 0x52414E44])
    pick = rng.choice(candidates.size, size=k, replace=False)
    pick.sort()
    return candidates[pick].astype(np.int32, copy=False)


class EF21:
    """EF21 state of one rank and its communication step. `valid`: the indices of the gradient region that
    hold real parameters (the region has alignment padding, which is always zero)."""

    def __init__(self, kind: str, ratio: float, n: int, valid: np.ndarray, dtype, seed: int = 0):
        if kind not in ("topk", "randk"):
            raise ValueError(f"compressor must be one of {', '.join(KINDS)}, got {kind!r}")
        self.kind, self.ratio, self.seed = kind, float(ratio), int(seed)
        self.dtype = np.dtype(dtype)
        self.n, self.valid = n, np.asarray(valid, np.int64)
        self.k = n_selected(ratio, self.valid.size)
        self.g_local = np.zeros(n, self.dtype)      # g_i
        self.g = np.zeros(n, self.dtype)            # mean_i g_i (identical on every rank)
        self.t = 0                                  # compressed steps done (RandK's seed stream)
        self.initialized = False                    # has the dense first step happened
        self._d = np.zeros(n, self.dtype)
        self._abs = np.zeros(n, self.dtype)
        isz = self.dtype.itemsize
        self._send = np.zeros(self.k * (isz + 4), np.uint8)     # TopK: [values | int32 indices]
        self._recv = None

    # ---- bytes one rank hands to MPI for the gradient in a step of each kind
    @property
    def dense_bytes(self) -> int:
        return self.n * self.dtype.itemsize

    @property
    def compressed_bytes(self) -> int:
        return self.k * (self.dtype.itemsize + (4 if self.kind == "topk" else 0))

    def reduce(self, grads: np.ndarray, comm) -> int:
        """In: this rank's gradient in `grads` (a view of the arena's grads region). Out: `grads` holds the
        EF21 estimate g of the mean gradient, the same on every rank. Returns the bytes this rank sent."""
        size = comm.Get_size()
        inv = 1.0 / size
        if not self.initialized:
            return self._dense_first(grads, comm, inv)
        d = np.subtract(grads, self.g_local, out=self._d)
        ok = self._topk(d, comm, size, inv) if self.kind == "topk" else self._randk(d, comm, inv)
        self.t += 1
        if ok:
            np.copyto(grads, self.g)
        else:
            grads.fill(np.nan)
        return self.compressed_bytes

    def _dense_first(self, grads, comm, inv) -> int:
        from mpi4py import MPI
        np.copyto(self._d, grads)                   # this rank's gradient, kept until the check passes
        comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
        if inv != 1.0:
            grads *= self.dtype.type(inv)
        if np.all(np.isfinite(grads)):              # the same verdict on every rank (same reduced values)
            np.copyto(self.g_local, self._d)
            np.copyto(self.g, grads)
            self.initialized = True
        return self.dense_bytes

    def _topk(self, d, comm, size, inv) -> bool:
        k, isz = self.k, self.dtype.itemsize
        idx = topk_indices(d, k, self._abs)
        vals = self._send[:k * isz].view(self.dtype)
        np.take(d, idx, out=vals)
        self._send[k * isz:].view(np.int32)[:] = idx
        if self._recv is None or self._recv.shape[0] != size:
            self._recv = np.zeros((size, self._send.size), np.uint8)
        comm.Allgather(self._send, self._recv)
        all_vals = self._recv[:, :k * isz].view(self.dtype)         # (size, k)
        all_idx = self._recv[:, k * isz:].view(np.int32)            # (size, k)
        if not np.all(np.isfinite(all_vals)):
            return False
        self.g_local[idx] += vals
        scale = self.dtype.type(inv)
        for r in range(size):                                         # rank order: identical on all ranks
            self.g[all_idx[r]] += all_vals[r] * scale
        return True

    def _randk(self, d, comm, inv) -> bool:
        from mpi4py import MPI
        idx = randk_indices(self.valid, self.k, self.seed, self.t)
        vals = d[idx]
        total = vals.copy()
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        if not np.all(np.isfinite(total)):
            return False
        self.g_local[idx] += vals
        self.g[idx] += total * self.dtype.type(inv)
        return True

    # ---- checkpoints: g and t are the same on every rank; g_local is per rank
    def shared_state(self) -> dict:
        return {"dist/ef_g": self.g.copy(), "dist/ef_t": np.array(self.t, np.int64),
                "dist/ef_initialized": np.array(int(self.initialized), np.int64)}

    def load(self, shared: dict, g_local: np.ndarray) -> None:
        g, gl = np.asarray(shared["dist/ef_g"]), np.asarray(g_local)
        if g.shape != self.g.shape or gl.shape != self.g_local.shape:
            raise ValueError(f"error-feedback state has shapes {g.shape}/{gl.shape}, expected {self.g.shape}")
        self.g[...] = g
        self.g_local[...] = gl
        self.t = int(shared["dist/ef_t"])
        self.initialized = bool(int(shared["dist/ef_initialized"]))
