# btjit/bench/peers/jax_peer.py -- the JAX peer: jax.jit of value_and_grad (+ the SGD update for E5/E6).
# compile_seconds = the first call (trace + XLA compile + one run), measured apart from step time
# (plain jax.jit is used, not .lower().compile(): its call path measured ~5-10% faster at E6b1).
# Every step blocks on its outputs (block_until_ready / float()), so async dispatch cannot hide work or
# overlap steps on a second core. E1/E2 run in float64 (jax_enable_x64 is set by make()).
# Threads: the harness sets XLA_FLAGS (--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1)
# in the environment before this module imports jax. E3/E4 are n/a (see peers/__init__.py).
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from btjit.bench import workloads as W
from btjit.bench.peers import NA_IO, NotApplicable, Runner


class ScalarRunner(Runner):
    def __init__(self, workload_id):
        jax.config.update("jax_enable_x64", True)
        s = W.WORKLOADS[workload_id].settings
        self.a = jnp.asarray(s["a"], dtype=jnp.float64)
        self.b = jnp.asarray(s["b"], dtype=jnp.float64)
        fn = W.e1 if workload_id == "E1" else (lambda a, b: W.e2(a, b, jax.nn.relu))
        self.fn = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        t0 = time.perf_counter()
        jax.block_until_ready(self.fn(self.a, self.b))
        self.compile_seconds = time.perf_counter() - t0

    def step(self):
        return jax.block_until_ready(self.fn(self.a, self.b))

    def check(self):
        g, (ga, gb) = self.step()
        return dict(g=float(g), dg_da=float(ga), dg_db=float(gb))


def _cross_entropy(logits, y):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def mlp_loss(P, x, y):
    B = x.shape[0]
    h = jnp.tanh(P["emb"][x].reshape(B, -1) @ P["w1"] + P["b1"])           # (B,1024)
    return _cross_entropy(h @ P["w2"] + P["b2"], y)


def _layer_norm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def gpt_loss(P, x, y, n_layer=6, n_head=6):
    B, T = x.shape
    C = P["wte"].shape[1]
    hs = C // n_head
    mask = jnp.tril(jnp.ones((T, T), bool))
    h = (P["wte"][x] + P["wpe"][:T]).reshape(B * T, C)                        # (B*T,C)
    for i in range(n_layer):
        p = f"h{i}."
        a = _layer_norm(h, P[p + "ln1.g"], P[p + "ln1.b"])
        qkv = (a @ P[p + "attn.qkv.w"]).reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]                                     # (B,NH,T,hs)
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))           # (B,NH,T,T)
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(B * T, C)
        h = h + o @ P[p + "attn.proj.w"] + P[p + "attn.proj.b"]
        m = _layer_norm(h, P[p + "ln2.g"], P[p + "ln2.b"])
        m = jax.nn.relu(m @ P[p + "mlp.fc.w"] + P[p + "mlp.fc.b"])
        h = h + m @ P[p + "mlp.proj.w"] + P[p + "mlp.proj.b"]
    h = _layer_norm(h, P["lnf.g"], P["lnf.b"])
    return _cross_entropy(h @ P["head.w"] + P["head.b"], y.reshape(-1))


class TrainRunner(Runner):
    note = "jit(value_and_grad + SGD), params donated"

    def __init__(self, workload_id, seed=0, text=None):
        w = W.WORKLOADS[workload_id]
        params, x, y, self.vocab, self.data = W.setup_batch(workload_id, seed, text)
        self.P = {k: jnp.asarray(v) for k, v in params.items()}
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        loss_fn = mlp_loss if w.kind == "mlp" else gpt_loss
        lr = w.settings["lr"]

        def train_step(P, x, y):
            loss, g = jax.value_and_grad(loss_fn)(P, x, y)
            return loss, jax.tree_util.tree_map(lambda p, d: p - lr * d, P, g)

        self._train = jax.jit(train_step, donate_argnums=0)
        self._loss = jax.jit(loss_fn)
        t0 = time.perf_counter()                # first call = trace + compile + one step (on a copy, so
        P0 = jax.tree_util.tree_map(jnp.copy, self.P)   # the runner still starts at the init params)
        jax.block_until_ready(self._train(P0, self.x, self.y))
        self.compile_seconds = time.perf_counter() - t0

    def step(self):
        loss, self.P = self._train(self.P, self.x, self.y)
        return float(loss)                      # blocks until the step is done

    def check(self):
        return dict(loss=float(self._loss(self.P, self.x, self.y)), vocab=self.vocab,
                    ln_vocab=math.log(self.vocab))

    def params(self):
        return {k: np.asarray(v).copy() for k, v in self.P.items()}


def make(workload_id, threads=1, seed=0, text=None, **_ignored):
    kind = W.WORKLOADS[workload_id].kind
    if kind == "scalar":
        return ScalarRunner(workload_id)
    if kind == "io":
        raise NotApplicable(NA_IO)
    return TrainRunner(workload_id, seed=seed, text=text)
