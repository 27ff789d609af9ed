# btjit/sampling.py -- text generation with a forward-only program of a model's logits (a Model of
# btjit.train.registry, whose model_for() maps the [model] section to a model): Sampler traces the logits
# once (batch 1) and draws characters with temperature and top-k from a seeded numpy Generator, as the model's
# data format needs: "text" one stream, "lines" and "words" one word per line. Used by `btjit train`
# (samples during training) and `btjit sample`. No training here.
from __future__ import annotations

import numpy as np

from btjit.train.data import PAD, DataError, Vocab
from btjit.train.registry import Model, model_for  # noqa: F401  (model_for: its old home)


class SampleError(ValueError):
    """The model's logits cannot be sampled from (NaN, +inf, or all -inf: its params have diverged)."""


def pick(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0) -> int:
    """One token id from a (V,) logits row. temperature 0 = greedy; top_k 0 = all tokens. -inf logits are tokens
    that cannot follow; NaN or +inf, or no finite logit, is a SampleError."""
    z = np.asarray(logits, dtype=np.float64)
    if np.isnan(z).any() or np.isposinf(z).any() or not np.isfinite(z).any():
        what = "NaN" if np.isnan(z).any() else "+inf" if np.isposinf(z).any() else "-inf only"
        raise SampleError(f"the model's logits are not finite ({what}): its parameters have diverged")
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
    """A batch-1 forward program of a Model's logits, for generating text, by the model's data format.
    "text": the program takes idx (1, block_size); a shorter context is right-padded and the logits are read at
    its last position (the attention is causal, so padding after it cannot change them).
    "lines": the program takes x (1, context) -> (1, V); names are generated one at a time until '.'.
    "words" (makemore.py): idx (1, block_size) starting with the start token 0, right-padded, the logits read
    at the last position; a word ends at token 0 or at block_size - 1 characters (the longest the data holds)."""

    def __init__(self, model: Model, vocab: Vocab, params: dict, dtype: str = "float32", buffers: dict | None = None):
        import btjit
        self.format, self.vocab, self.model = model.format, vocab, model
        self.block = model.cfg.context if self.format == "lines" else model.cfg.block_size
        example = np.zeros((1, self.block), dtype=np.int32)
        with model.guard("tracing logits(p, x) (for samples)"):
            self.fwd = btjit.trace(model.logits, params, example, optimizer=None, dtype=dtype, buffers=buffers,
                                   training=False)
        want = (1, len(vocab)) if self.format == "lines" else (1, self.block, len(vocab))
        got = tuple(self.fwd.graph.outputs["out"].shape)
        if got != want and model.model_file is not None:
            from btjit.train.usermodel import ModelFileError
            raise ModelFileError(f"{model.model_file.name}: logits(p, x) of x {example.shape} must return shape "
                                 f"{want} for data.format = \"{self.format}\", got {got}")
        self.set_params(params, buffers)

    def set_params(self, params: dict, buffers: dict | None = None) -> None:
        """Copy parameter and buffer values (e.g. prog.params, prog.buffers of the training program) into the
        forward program."""
        for name, dst in self.fwd.params.items():
            dst[...] = params[name]
        for name, dst in self.fwd.buffers.items():
            dst[...] = buffers[name]

    def _logits(self, ctx: list[int]) -> np.ndarray:
        idx = np.zeros((1, self.block), dtype=np.int32)
        if self.format == "lines":
            idx[0, :] = ctx[-self.block:]
            return np.asarray(self.fwd(idx)).reshape(-1)
        window = ctx[-self.block:]
        idx[0, :len(window)] = window
        return np.asarray(self.fwd(idx))[0, len(window) - 1]

    def check_prompt(self, prompt: str) -> None:
        for c in prompt:
            if c not in self.vocab.stoi or (self.format != "text" and c == PAD):
                raise DataError(f"prompt character {c!r} is not in the model's vocabulary "
                                f"({len(self.vocab)} characters)")
        if self.format == "words" and len(prompt) > self.block - 2:
            raise DataError(f"the prompt has {len(prompt)} characters; this model's words have at most "
                            f"block_size - 1 = {self.block - 1}, so a prompt at most {self.block - 2}")

    def generate(self, prompt: str, n: int, rng: np.random.Generator,
                 temperature: float = 1.0, top_k: int = 0) -> str:
        """"text": the prompt followed by n generated characters. "lines", "words": words, one per line, each
        starting with the prompt, until n characters have been generated."""
        self.check_prompt(prompt)
        ids = [self.vocab.stoi[c] for c in prompt]
        if self.format == "text":
            ctx = ids or [self.vocab.stoi.get("\n", 0)]
            out = []
            for _ in range(n):
                nxt = pick(self._logits(ctx), rng, temperature, top_k)
                ctx.append(nxt)
                out.append(nxt)
            return prompt + self.vocab.decode(out)
        lines, made = [], 0
        start = [0] * self.block if self.format == "lines" else [0]
        longest = 10 * self.block + 100 if self.format == "lines" else self.block - 1 - len(ids)
        while made < n:
            ctx, word = start + ids, []
            while made < n and len(word) < longest:
                nxt = pick(self._logits(ctx), rng, temperature, top_k)
                made += 1
                if nxt == 0:
                    break
                ctx.append(nxt)
                word.append(nxt)
            lines.append(prompt + self.vocab.decode(word))
        return "\n".join(lines)
