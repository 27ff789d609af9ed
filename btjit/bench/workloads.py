# btjit/bench/workloads.py -- the benchmark workload registry E1..E6 (exact definitions from
# ../shared/PAPER.md) and the numpy helpers every implementation shares: the E1/E2 scalar graphs written
# once over operator overloading, data loading (real file or a generated stand-in of the same shape),
# the E5 dataset, E6 batch sampling, and the E5/E6 parameter init as named numpy arrays.
# Not here: any timing (harness.py / run_one.py) or any framework code (peers/, btjit_impl.py).
#
# Parameter naming (weights stored (in, out), so y = x @ w + b; float32):
#   E6 GPT:  wte (V,C)  wpe (T,C)  then per layer i in 0..5:
#            h{i}.ln1.g (C)  h{i}.ln1.b (C)  h{i}.attn.qkv.w (C,3C)  h{i}.attn.proj.w (C,C)  h{i}.attn.proj.b (C)
#            h{i}.ln2.g (C)  h{i}.ln2.b (C)  h{i}.mlp.fc.w (C,4C)  h{i}.mlp.fc.b (4C)  h{i}.mlp.proj.w (4C,C)
#            h{i}.mlp.proj.b (C)   then lnf.g (C)  lnf.b (C)  head.w (C,V)  head.b (V).
#            qkv has NO bias: the paper's 46,337 parameters are exactly Karpathy's gpt.py (key/query/value
#            Linear(bias=False)); with a qkv bias the count would be 46,769.
#            qkv columns: [0:C] = q, [C:2C] = k, [2C:3C] = v; head h uses columns h*hs:(h+1)*hs of each.
#            Attention is causal, scaled by 1/sqrt(hs); LayerNorm eps 1e-5; FFN is ReLU.
#            Init: N(0, 0.02) for every Linear/Embedding weight, zero biases, LayerNorm g=1, b=0.
#   E5 MLP:  emb (27,64)  w1 (1024,1024)  b1 (1024)  w2 (1024,27)  b2 (27)
#            Init (makemore part 3 style, so the first loss is ~ln 27): emb N(0,1), w1 N(0,1)*(5/3)/sqrt(1024),
#            b1 N(0,1)*0.01, w2 N(0,1)*0.01, b2 0.
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from btjit.models import gpt, mlp   # numpy-only at import: peers' processes load them without numba


@dataclass(frozen=True)
class Workload:
    id: str
    kind: str          # "scalar" (E1,E2), "io" (E3,E4), "mlp" (E5), "gpt" (E6*)
    what: str
    settings: dict = field(default_factory=dict)


WORKLOADS = {w.id: w for w in [
    Workload("E1", "scalar", "tiny scalar graph, value and gradient wrt a, b (float64)", dict(a=-41.0, b=2.0)),
    Workload("E2", "scalar", "micrograd README graph, value and gradient (float64)", dict(a=-4.0, b=2.0)),
    Workload("E3", "io", "save the 7 named node values a..g of E2 to a file", dict(nodes=7)),
    Workload("E4", "io", "load the 7 named node values a..g of E2 from a file", dict(nodes=7)),
    Workload("E5", "mlp", "makemore MLP step on names.txt (fwd+bwd+SGD)",
             dict(context=16, emb=64, hidden=1024, vocab=27, batch=64, lr=0.1)),
    Workload("E6b1", "gpt", "mini GPT-3 step on Tiny Shakespeare, batch 1 (fwd+bwd+SGD)",
             dict(n_layer=6, n_head=6, n_embd=24, block=8, batch=1, lr=3e-4)),
    Workload("E6b64", "gpt", "mini GPT-3 step on Tiny Shakespeare, batch 64 (fwd+bwd+SGD)",
             dict(n_layer=6, n_head=6, n_embd=24, block=8, batch=64, lr=3e-4)),
]}
PAPER_SUITE = list(WORKLOADS)

# ---- E1 / E2: written once; works on floats, micrograd Values, torch tensors, jax tracers, autograd boxes
E1_ANSWER = dict(g=612.5, dg_da=-35.0, dg_db=1050.0)
E2_ANSWER = dict(g=24.7041, dg_da=138.8338, dg_db=645.5773)   # 4 decimals; BurTorch gets 104.125/680.286
E2_NODES = ("a", "b", "c", "d", "e", "f", "g")                 # the 7 named nodes E3/E4 save and load


def e1(a, b):
    c = a + b
    d = a * b + b ** 3
    e = c - d
    f = e ** 2
    return f / 2


def e2_nodes(a, b, relu):
    """The micrograd README graph; `x += y` written as `x = x + y` (same values, no in-place autograd)."""
    c = a + b
    d = a * b + b ** 3
    c = c + c + 1
    c = c + 1 + c + (-a)
    d = d + d * 2 + relu(b + a)
    d = d + 3 * d + relu(b - a)
    e = c - d
    f = e ** 2
    g = f / 2
    g = g + 10.0 / f
    return dict(a=a, b=b, c=c, d=d, e=e, f=f, g=g)


def e2(a, b, relu):
    return e2_nodes(a, b, relu)["g"]


def e2_values():
    """The 7 node values of E2 as Python floats (what E3 saves)."""
    return {k: float(v) for k, v in e2_nodes(-4.0, 2.0, lambda x: max(x, 0.0)).items()}


def check_ok(workload_id, check):
    """Compare a Runner.check() dict with the paper's answers -> (ok, message)."""
    w = WORKLOADS[workload_id]
    if w.kind == "scalar":
        want = E1_ANSWER if workload_id == "E1" else E2_ANSWER
        bad = [f"{k}={check.get(k)} want {v}" for k, v in want.items()
               if check.get(k) is None or abs(check[k] - v) > 1e-4 * max(1.0, abs(v))]
        return (not bad), "; ".join(bad)
    if w.kind == "io":
        want = e2_values()
        bad = [k for k in E2_NODES if k not in check or abs(check[k] - want[k]) > 1e-9 * max(1, abs(want[k]))]
        return (not bad), ("wrong nodes " + ",".join(bad)) if bad else ""
    vocab = 27 if w.kind == "mlp" else check.get("vocab", 65)
    want, loss = math.log(vocab), check.get("loss")
    ok = loss is not None and abs(loss - want) < 0.1
    return ok, "" if ok else f"initial loss {loss} not within 0.1 of ln({vocab})={want:.4f}"


# ---- data: a real file from a data dir, else a generated stand-in of the same shape
SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"   # 65 chars


def data_dirs():
    """Search order. BTJIT_DATA_DIR, when set, is authoritative (set it to an empty dir to force generated)."""
    env = os.environ.get("BTJIT_DATA_DIR")
    if env is not None:
        return [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    return [Path.cwd() / ".." / "shared" / "data", repo / ".." / "shared" / "data"]


def find_data_file(name):
    for d in data_dirs():
        p = d / name
        if p.is_file():
            return p
    return None


def load_text(name="tinyshakespeare.txt"):
    """-> (text, source) where source is the file name or "generated"."""
    p = find_data_file(name)
    if p is not None:
        return p.read_text(encoding="utf-8"), name
    rng = np.random.default_rng(1234)
    if name == "names.txt":
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        lens = rng.integers(3, 11, size=32033)
        flat = rng.choice(letters, size=int(lens.sum()))
        cuts = np.cumsum(lens)[:-1]
        words = ["".join(w) for w in np.split(flat, cuts)]
        words[0] = "abcdefghijklmnopqrstuvwxyz"            # every letter present -> vocab 27
        return "\n".join(words) + "\n", "generated"
    chars = np.array(list(SHAKESPEARE_CHARS))
    body = rng.choice(chars, size=1115394 - len(SHAKESPEARE_CHARS))
    return SHAKESPEARE_CHARS + "".join(body.tolist()), "generated"


# ---- E5: makemore dataset (context 16 left-padded with '.', '.' = 0, letters sorted from 1)
def e5_dataset(text=None, context=16):
    """-> (X int32 (N,context), Y int32 (N,), itos str, source)."""
    source = "given"
    if text is None:
        text, source = load_text("names.txt")
    words = text.split()
    itos = "." + "".join(sorted(set("".join(words))))
    lut = np.zeros(256, np.int32)
    lut[np.frombuffer(itos.encode(), np.uint8)] = np.arange(len(itos), dtype=np.int32)
    stream, targets, pos = [], [], 0
    for w in words:                      # segment = 16 pads + ids + '.'; targets are the last L+1 entries
        ids = lut[np.frombuffer(w.encode(), np.uint8)].tolist()
        stream.extend([0] * context + ids + [0])
        targets.append(np.arange(pos + context, pos + context + len(ids) + 1))
        pos += context + len(ids) + 1
    s = np.asarray(stream, np.int32)
    t = np.concatenate(targets)
    X = s[t[:, None] + np.arange(-context, 0)]
    return X, s[t], itos, source


def e5_batch(X, Y, batch=64, seed=0):
    idx = np.random.default_rng(seed).integers(0, len(X), size=batch)
    return np.ascontiguousarray(X[idx]), np.ascontiguousarray(Y[idx])


def e5_init(seed=0, vocab=27, emb=64, context=16, hidden=1024):
    """The E5 parameters: btjit.models.mlp's init (makemore part-3 style), the same for every impl."""
    return mlp.init_params(mlp.MLPConfig(vocab_size=vocab, context=context, n_emb=emb, n_hidden=hidden), seed)


# ---- E6: Tiny Shakespeare, vocab from the corpus, 90/10 split, random blocks
def e6_corpus(text=None):
    """-> (itos str, train int32, val int32, source)."""
    source = "given"
    if text is None:
        text, source = load_text("tinyshakespeare.txt")
    itos = "".join(sorted(set(text)))
    if text.isascii():
        lut = np.zeros(128, np.int32)
        lut[np.frombuffer(itos.encode(), np.uint8)] = np.arange(len(itos), dtype=np.int32)
        ids = lut[np.frombuffer(text.encode(), np.uint8)]
    else:
        lut = {ch: i for i, ch in enumerate(itos)}
        ids = np.fromiter((lut[ch] for ch in text), np.int32, count=len(text))
    n = int(0.9 * len(ids))
    return itos, ids[:n], ids[n:], source


def e6_batch(data, batch, block=8, seed=0):
    """Random blocks of `block` tokens: x (B,T) int32, y (B,T) int32 = x shifted by one."""
    ix = np.random.default_rng(seed).integers(0, len(data) - block, size=batch)
    off = ix[:, None] + np.arange(block)
    return np.ascontiguousarray(data[off]), np.ascontiguousarray(data[off + 1])


def e6_config(vocab=65, n_layer=6, n_embd=24, block=8):
    return gpt.GPTConfig(vocab_size=vocab, n_layer=n_layer, n_head=6, n_embd=n_embd, block_size=block)


def e6_param_shapes(vocab=65, n_layer=6, n_embd=24, block=8):
    return gpt.param_shapes(e6_config(vocab, n_layer, n_embd, block))


def e6_init(vocab=65, seed=0, n_layer=6, n_embd=24, block=8):
    """The E6 parameters: btjit.models.gpt's init (N(0, 0.02) weights, zero biases, LayerNorm 1/0)."""
    return gpt.init_params(e6_config(vocab, n_layer, n_embd, block), seed)


def n_params(params):
    return int(sum(int(np.prod(p.shape)) for p in params.values()))


def setup_batch(workload_id, seed=0, text=None):
    """What every E5/E6 runner starts from: (params, x, y, vocab, source) -- batch pre-sampled, not timed."""
    w = WORKLOADS[workload_id]
    if w.kind == "mlp":
        X, Y, itos, source = e5_dataset(text)
        x, y = e5_batch(X, Y, w.settings["batch"], seed)
        return e5_init(seed, vocab=len(itos)), x, y, len(itos), source
    if w.kind == "gpt":
        itos, train, _val, source = e6_corpus(text)
        x, y = e6_batch(train, w.settings["batch"], w.settings["block"], seed)
        return e6_init(len(itos), seed), x, y, len(itos), source
    raise ValueError(f"{workload_id} has no batch (kind {w.kind})")
