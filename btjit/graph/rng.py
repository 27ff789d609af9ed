"""The program side of the random numbers (btjit/kernels/rng.py): the key block's seed and replica words in
the int arena, and the row that counts steps where the update does not."""
from __future__ import annotations

from btjit.kernels import rng as K
from btjit.kernels.library import LIBRARY


def set_key(IA, okey: int, seed: int) -> None:
    """Write the seed into every replica's key block (rows of IA) and each replica's index."""
    lo, hi = K.seed_words(seed)
    for r in range(IA.shape[0]):
        IA[r, okey + K.KEY_SEED], IA[r, okey + K.KEY_SEED + 1], IA[r, okey + K.KEY_REPLICA] = lo, hi, r


def tick_rows(graph, update_rows, L, plan) -> list:
    """[k_step_tick] when the graph draws random numbers and the update rows do not count steps (AdamW's
    does; SGD's does not): the count is the generator's step, new numbers every step."""
    if graph.rng_key is None or not update_rows:
        return []
    if any(r[0] == LIBRARY.opcode("k_adamw") for r in update_rows):
        return []
    return [L.row("k_step_tick", ostep=plan.int_state)]
