"""einops on traced values: `rearrange`, `repeat`, `reduce`, `einsum`, `pack` / `unpack` as lucidrains' models
write them (`rearrange(t, 'b n (h d) -> b h n d', h=heads)`, `repeat(cls, '1 1 d -> b 1 d', b=b)`).

einops finds a backend by scanning the subclasses of its AbstractBackend whose framework is imported; btjit.trace
imports this module when the user's code has imported einops, so a program that does not use einops loads none
of it. Every operation is one of btjit's (reshape, transpose, tile, reductions), so gradients flow as usual.
"""
from __future__ import annotations

from einops._backends import AbstractBackend

from btjit.graph import trace as T
from btjit.graph.numpy_fns import expand_dims, stack, tile
from btjit.graph.numpy_more import einsum


class BtjitBackend(AbstractBackend):
    framework_name = "btjit"

    def is_appropriate_type(self, tensor):
        return isinstance(tensor, T.Tracer)

    def arange(self, start, stop):
        return T.arange(start, stop)

    def stack_on_zeroth_dimension(self, tensors: list):
        return stack(tensors, 0)

    def add_axis(self, x, new_position):
        return expand_dims(x, new_position)

    def tile(self, x, repeats):
        return tile(x, repeats)

    def concat(self, tensors, axis: int):
        return T.concatenate(tensors, axis)

    def is_float_type(self, x):
        return x.dtype.kind == "f"

    def einsum(self, pattern, *x):
        return einsum(pattern, *x)
