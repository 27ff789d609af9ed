"""btjit.optim: optimizers as traced programs.

    opt = btjit.optim.AdamW(lr=1e-3, weight_decay=0.1, groups=btjit.optim.decay_matrices())
    prog = btjit.trace(loss_fn, params, x, y, optimizer=opt)
    prog.hp["beta1"] = 0.95                     # hyper-parameters are arena slots: no recompiling

The built-ins (torch.optim's semantics) and a user's subclass of `Optimizer` are the same kind of thing: an
`update` written with btjit's tensor ops, traced into the step after the backward (btjit/optim/build.py).
"""
from btjit.optim.base import Optimizer, OptimizerError, decay_matrices, resolve_groups
from btjit.optim.builtin import SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, Lion, NAdam, RAdam, RMSprop, sign
from btjit.optim.config import BUILTIN, from_section

__all__ = ["Optimizer", "OptimizerError", "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
           "Adamax", "Lion", "decay_matrices", "resolve_groups", "sign", "BUILTIN", "from_section"]
