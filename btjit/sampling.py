# btjit/sampling.py -- from a run config to a model, and text generation with a forward-only program:
# model_for() maps the [model] section to btjit.models.gpt / btjit.models.mlp, Sampler traces the
# model's logits function once (batch 1) and draws characters with temperature and top-k from a seeded
# numpy Generator. Used by `btjit train` (samples during training) and `btjit sample`. No training here.
from __future__ import annotations

import numpy as np

from btjit.data import PAD, DataError, Vocab


def model_for(model_cfg, vocab_size: int):
    """(models module, its config object) for a btjit.config.ModelConfig."""
    if model_cfg.kind == "gpt":
        from btjit.models import gpt
        return gpt, gpt.GPTConfig(vocab_size=vocab_size, n_layer=model_cfg.n_layer,
                                  n_head=model_cfg.n_head, n_embd=model_cfg.n_embd,
                                  block_size=model_cfg.block_size, activation=model_cfg.activation)
    from btjit.models import mlp
    return mlp, mlp.MLPConfig(vocab_size=vocab_size, context=model_cfg.context,
                              n_emb=model_cfg.n_emb, n_hidden=model_cfg.n_hidden)


def pick(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0) -> int:
    """One token id from a (V,) logits row. temperature 0 = greedy; top_k 0 = all tokens."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        return int(np.argmax(z))
    z = z / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


class Sampler:
    """A batch-1 forward program of the model's logits, for generating text.
    GPT: the program takes idx (1, block_size); a shorter context is right-padded and the logits are
    read at its last position (the attention is causal, so padding after it cannot change them).
    MLP: the program takes x (1, context); names are generated one at a time until '.'."""

    def __init__(self, model_cfg, vocab: Vocab, params: dict, dtype: str = "float32"):
        import btjit
        self.kind, self.vocab = model_cfg.kind, vocab
        self.block = model_cfg.block_size if self.kind == "gpt" else model_cfg.context
        module, mcfg = model_for(model_cfg, len(vocab))
        example = np.zeros((1, self.block), dtype=np.int32)
        self.fwd = btjit.trace(module.logits_fn(mcfg), params, example, optimizer=None, dtype=dtype)
        self.set_params(params)

    def set_params(self, params: dict) -> None:
        """Copy parameter values (e.g. prog.params of the training program) into the forward program."""
        for name, dst in self.fwd.params.items():
            dst[...] = params[name]

    def _logits(self, ctx: list[int]) -> np.ndarray:
        idx = np.zeros((1, self.block), dtype=np.int32)
        if self.kind == "gpt":
            window = ctx[-self.block:]
            idx[0, :len(window)] = window
            return np.asarray(self.fwd(idx))[0, len(window) - 1]
        idx[0, :] = ctx[-self.block:]
        return np.asarray(self.fwd(idx)).reshape(-1)

    def check_prompt(self, prompt: str) -> None:
        for c in prompt:
            if c not in self.vocab.stoi or (self.kind == "mlp" and c == PAD):
                raise DataError(f"prompt character {c!r} is not in the model's vocabulary "
                                f"({len(self.vocab)} characters)")

    def generate(self, prompt: str, n: int, rng: np.random.Generator,
                 temperature: float = 1.0, top_k: int = 0) -> str:
        """GPT: the prompt followed by n generated characters. MLP: names, one per line, each
        starting with the prompt, until n characters have been generated."""
        self.check_prompt(prompt)
        ids = [self.vocab.stoi[c] for c in prompt]
        if self.kind == "gpt":
            ctx = ids or [self.vocab.stoi.get("\n", 0)]
            out = []
            for _ in range(n):
                nxt = pick(self._logits(ctx), rng, temperature, top_k)
                ctx.append(nxt)
                out.append(nxt)
            return prompt + self.vocab.decode(out)
        lines, made = [], 0
        while made < n:
            ctx, word = [0] * self.block + ids, []
            while made < n and len(word) < 10 * self.block + 100:
                nxt = pick(self._logits(ctx), rng, temperature, top_k)
                made += 1
                if nxt == 0:
                    break
                ctx.append(nxt)
                word.append(nxt)
            lines.append(prompt + self.vocab.decode(word))
        return "\n".join(lines)
