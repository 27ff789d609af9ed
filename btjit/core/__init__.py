"""A traced program: `trace()` runs the graph pipeline (trace, autodiff, fuse, plan, lower) and `Program` holds
the arena and the kernel tape (program.py); the one native executor runs the tape (executor.py)."""
