"""The arena planner's placement (btjit/graph/memory.py place): buffers alive at the same time never share memory,
and the vectorized greedy places every buffer where the plain greedy it implements does (written out here)."""
import numpy as np
import pytest

from btjit.graph.memory import place


def _greedy(sizes, life):
    """Largest first (then earliest), each at the lowest offset clear of every placed buffer alive with it."""
    placed, offs, top = [], {}, 0
    for s in sorted(sizes, key=lambda s: (-sizes[s], life[s][0])):
        lo, hi = life[s]
        off = 0
        for b0, b1 in sorted((o, o + n) for o, n, l2, h2 in placed if not (h2 < lo or l2 > hi)):
            if off + sizes[s] <= b0:
                break
            off = max(off, b1)
        offs[s] = off
        placed.append((off, sizes[s], lo, hi))
        top = max(top, off + sizes[s])
    return offs, top


@pytest.mark.parametrize("seed", range(40))
def test_place_is_the_greedy_and_never_overlaps_live_buffers(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 120))
    sizes = {f"v{i}": int(rng.choice([1, 3, 8, 16, 64, int(rng.integers(1, 200))])) for i in range(n)}
    life = {}
    for s in sizes:
        a = int(rng.integers(0, 80))
        life[s] = [a, a + int(rng.choice([0, 2, 10, 60]))]
    offs, top = place(sizes, life)
    assert (offs, top) == _greedy(sizes, life)
    for a in sizes:
        for b in sizes:
            if a < b and not (life[a][1] < life[b][0] or life[b][1] < life[a][0]):
                assert offs[a] + sizes[a] <= offs[b] or offs[b] + sizes[b] <= offs[a], (a, b)
    assert top == max(offs[s] + sizes[s] for s in sizes)
