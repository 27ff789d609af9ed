"""A traced program: `trace()` runs the graph pipeline (trace, autodiff, fuse; tracing.py) and `Program` plans,
lowers and holds the arena and the kernel tape (program.py); the one native executor runs the tape (executor.py)."""
