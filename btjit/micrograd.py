"""micrograd's `Value`, with the gradients computed by btjit: code written against micrograd.engine runs with
only its import changed (`from btjit.micrograd import Value`).

    a, b = Value(-4.0), Value(2.0)
    g = (a * b + b ** 3).relu() / 2.0
    g.backward()                   # traced by btjit.trace_scalar, compiled (or found in the cache), run natively
    a.grad, b.grad, g.data

A Value records its operation eagerly, as micrograd's does, and computes `.data` in Python with micrograd's own
formulas (so `.data` is micrograd's, bit for bit). `backward()` replays the recorded graph as a btjit scalar
function of every node -- the leaves' values, and for each other node a zero added to it, whose gradient is that
node's -- and adds the native gradients into `.grad` of every node, as micrograd's backward does (the root's
grad is set to 1). Graphs of one structure (the same operations in the same order, whatever the numbers: a
training loop's steps) reuse one compiled function.

Operations: + - * / ** (a number exponent), unary minus, relu() as micrograd, and the tensor methods tanh()
exp() log() sigmoid() sqrt() abs(). Not a tensor library: for anything larger, write the function for
btjit.trace_scalar or btjit.trace directly.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

CACHE_SIZE = 16          # compiled functions kept, by graph structure
_CACHE: OrderedDict = OrderedDict()


class Value:
    """ stores a single scalar value and its gradient """

    def __init__(self, data, _children=(), _op=''):
        self.data = data
        self.grad = 0
        self._args = tuple(_children)      # ordered operands (micrograd keeps the set _prev for drawing)
        self._prev = set(_children)
        self._op = _op

    def __add__(self, other):
        other = other if isinstance(other, Value) else Value(other)
        return Value(self.data + other.data, (self, other), '+')

    def __mul__(self, other):
        other = other if isinstance(other, Value) else Value(other)
        return Value(self.data * other.data, (self, other), '*')

    def __pow__(self, other):
        if not isinstance(other, (int, float)):
            raise TypeError(f"Value ** {type(other).__name__}: only int/float powers are supported (as micrograd)")
        return Value(self.data ** other, (self,), f'**{other}')

    def relu(self):
        return Value(0 if self.data < 0 else self.data, (self,), 'ReLU')

    def _unary(self, op, fn):
        return Value(fn(self.data), (self,), op)

    def tanh(self):
        return self._unary('tanh', math.tanh)

    def exp(self):
        return self._unary('exp', math.exp)

    def log(self):
        return self._unary('log', math.log)

    def sigmoid(self):
        return self._unary('sigmoid', lambda x: 1.0 / (1.0 + math.exp(-x)))

    def sqrt(self):
        return self._unary('sqrt', math.sqrt)

    def abs(self):
        return self._unary('abs', abs)

    def __neg__(self):
        return self * -1

    def __radd__(self, other):
        return self + other

    def __sub__(self, other):
        return self + (-other)

    def __rsub__(self, other):
        return other + (-self)

    def __rmul__(self, other):
        return self * other

    def __truediv__(self, other):
        return self * other ** -1

    def __rtruediv__(self, other):
        return other * self ** -1

    def __repr__(self):
        return f"Value(data={self.data}, grad={self.grad})"

    def backward(self):
        """Gradients of this value with respect to every node of its graph, added into their .grad."""
        topo = _topo(self)
        index = {id(v): i for i, v in enumerate(topo)}
        key = tuple((v._op, tuple(index[id(c)] for c in v._args)) for v in topo)
        f = _CACHE.get(key)
        if f is None:
            f = _compile(topo, key)
            _CACHE[key] = f
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        _CACHE.move_to_end(key)
        X = np.array([[float(v.data) if not v._args else 0.0 for v in topo]])
        _, G = f.many(X)
        for v, g in zip(topo, G[0].tolist()):
            v.grad += g
        self.grad = 1


def _topo(root):
    """The nodes under root, children before parents (an explicit stack: graphs deeper than the recursion
    limit are fine)."""
    topo, seen, stack = [], set(), [(root, False)]
    while stack:
        v, done = stack.pop()
        if done:
            topo.append(v)
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        stack.append((v, True))
        stack.extend((c, False) for c in reversed(v._args) if id(c) not in seen)
    return topo


_UNARY = {'ReLU': lambda x: x.relu(), 'tanh': lambda x: x.tanh(), 'exp': lambda x: x.exp(),
          'log': lambda x: x.log(), 'sigmoid': lambda x: x.sigmoid(), 'sqrt': lambda x: x.sqrt(),
          'abs': lambda x: x.abs()}


def _compile(topo, key):
    """A btjit scalar function of one input per node (a leaf's value, or a zero added to the node) whose
    gradient with respect to input i is d root / d node i."""
    from btjit.scalar.front import trace_scalar

    def fn(*xs):
        vals = []
        for (op, args), x in zip(key, xs):
            a = [vals[i] for i in args]
            if not args:
                vals.append(x)
                continue
            if op == '+':
                y = a[0] + a[1]
            elif op == '*':
                y = a[0] * a[1]
            elif op.startswith('**'):
                y = a[0] ** float(op[2:])
            else:
                y = _UNARY[op](a[0])
            vals.append(y + x)
        return vals[-1]
    return trace_scalar(fn, "float64", n_args=len(topo), compile=False)
