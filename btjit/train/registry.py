"""From a [model] config section (btjit.train.config.ModelConfig) to a Model: the built-in kinds (the paper's GPT and
MLP, makemore.py's six models) and the user's model file (kind "python", btjit.train.usermodel). A Model is what
`btjit train` and `btjit sample` need of any model: init_params(rng) -> dict, loss(p, x, y), logits(p, x), the
data format it reads, a one-line description, its buffers (init_buffers, or None), and `guard(what)`, which
turns an error raised in the user's code into one line naming the file and line (a no-op for the built-in
models)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Model:
    kind: str
    cfg: Any                            # GPTConfig, MLPConfig, MakemoreConfig, or the user's cfg namespace
    init_params: Callable[[Any], dict]  # rng (numpy Generator or seed) -> name -> float array
    loss: Callable                      # (p, x, y) -> scalar loss
    logits: Callable                    # (p, x) -> logits: (B, T, V) for "text" and "words", (B, V) for "lines"
    format: str                         # the data format of x and y: "text", "lines" or "words"
    arch: str                           # for the start-up banner
    mean_over_batch: bool               # the loss is a mean over the batch's first axis (replicas may split it)
    model_file: Any = None              # btjit.train.usermodel.ModelFile of kind "python"
    init_buffers: Callable[[], dict] | None = None   # () -> name -> float array: the model's buffers, if any

    def buffers(self) -> dict | None:
        return self.init_buffers() if self.init_buffers else None

    def guard(self, what: str):
        if self.model_file is None:
            return contextlib.nullcontext()
        from btjit.train import usermodel
        return usermodel.guard(self.model_file.name, str(self.model_file.path), what)


def model_for(m, vocab_size: int, model_file=None, data_format: str | None = None) -> Model:
    """The Model of ModelConfig `m` with `vocab_size` characters. kind "python" needs `model_file` (a
    btjit.train.usermodel.ModelFile) and the run's `data_format`."""
    if m.kind == "gpt":
        from btjit.models import gpt
        c = gpt.GPTConfig(vocab_size=vocab_size, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                          block_size=m.block_size, activation=m.activation)
        return Model("gpt", c, lambda rng: gpt.init_params(c, rng), gpt.loss_fn(c), gpt.logits_fn(c), "text",
                     f"gpt {m.n_layer} layers, {m.n_head} heads, n_embd {m.n_embd}, block {m.block_size}, "
                     f"{m.activation}", True)
    if m.kind == "mlp":
        from btjit.models import mlp
        c = mlp.MLPConfig(vocab_size=vocab_size, context=m.context, n_emb=m.n_emb, n_hidden=m.n_hidden)
        return Model("mlp", c, lambda rng: mlp.init_params(c, rng), mlp.loss_fn(c), mlp.logits_fn(c), "lines",
                     f"mlp context {m.context}, n_emb {m.n_emb}, n_hidden {m.n_hidden}", True)
    if m.kind == "python":
        from btjit.train import usermodel
        if model_file is None:
            raise ValueError('model.kind = "python" needs its model file')
        c = usermodel.namespace(m, vocab_size)
        init, loss, logits = usermodel.functions(model_file, c)
        own = "".join(f", {k} {v}" for k, v in m.extra.items())
        return Model("python", c, init, loss, logits, data_format or "text",
                     f"python {model_file.name}{own}", False, model_file, usermodel.buffers_fn(model_file, c))
    from btjit.models import makemore
    c = makemore.MakemoreConfig(vocab_size=vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                                n_head=m.n_head, n_embd=m.n_embd, n_embd2=m.n_embd2)
    mm = makemore.model(m.kind, c)
    sizes = {"bigram": "", "makemore_mlp": f", n_embd {m.n_embd}, n_embd2 {m.n_embd2}",
             "rnn": f", n_embd {m.n_embd}, n_embd2 {m.n_embd2}", "gru": f", n_embd {m.n_embd}, n_embd2 {m.n_embd2}",
             "bow": f", n_embd {m.n_embd}, n_embd2 {m.n_embd2}",
             "transformer": f", {m.n_layer} layers, {m.n_head} heads, n_embd {m.n_embd}"}[m.kind]
    return Model(m.kind, c, mm.init_params, mm.loss, mm.logits, "words",
                 f"makemore {m.kind.replace('makemore_', '')}{sizes}, block {m.block_size}", False)
