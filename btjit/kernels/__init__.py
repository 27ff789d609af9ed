"""btjit kernels: plain @njit(**FM) functions `k_<name>(a, ia, r)` over a flat float arena (see notes/CONVENTIONS.md)."""
