"""Scalar (micrograd-style) graphs: `trace_scalar` (front.py) traces a function of Python scalars into the
ordinary IR; lower.py turns it into straight-line native code or a scalar tape; export.py writes it as a native
library; nodefile.py writes and reads named node values."""
