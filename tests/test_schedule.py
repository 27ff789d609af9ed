# tests/test_schedule.py -- LR schedules and gradient accumulation (btjit/schedule.py) and their use in
# `btjit train`: each schedule's LR sequence against its reference formula (nanoGPT's get_lr for cosine);
# the trainer sets each step's LR before the native step and logs it; resume mid-warm-up and mid-decay ends
# bit-identical to an uninterrupted run; k accumulated micro-batches equal one step on the k-times batch
# (float64, SGD with momentum and AdamW with clipping), in one process and through DataParallel.
import json
import math
import shutil
import types

import numpy as np
import pytest
from click.testing import CliRunner

import btjit
from btjit.train import checkpoint as K
from btjit.train import config as C
from btjit.train import schedule as S
from btjit.cli import cli
from btjit.models import gpt
from textdata import corpus, tiny_config, write_run_files


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py get_lr, verbatim but for the globals made arguments."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_cosine_is_nanogpts_get_lr():
    for lr, warm, end, lo in [(6e-4, 2000, 600000, 6e-5), (3e-3, 100, 3000, 3e-4), (1.0, 0, 10, 0.0)]:
        for it in list(range(0, 3 * warm + 50)) + list(range(end - 50, end + 50)):
            assert S.lr_at(it, lr, "cosine", warm, end, lo) == nanogpt_get_lr(it, lr, warm, end, lo), it


def test_schedules_by_hand():
    lr, warm, end, lo = 1.0, 4, 14, 0.1
    seq = {s: [S.lr_at(it, lr, s, warm, end, lo) for it in range(20)] for s in S.SCHEDULES}
    for s in S.SCHEDULES:                                   # warm-up: lr * (it + 1) / (warmup + 1)
        assert seq[s][:4] == pytest.approx([0.2, 0.4, 0.6, 0.8], abs=1e-15)
    assert seq["constant"][4:] == [1.0] * 16
    r = [(it - warm) / (end - warm) for it in range(4, 15)]
    assert seq["cosine"][4:15] == pytest.approx([lo + 0.5 * (1 + math.cos(math.pi * x)) * (lr - lo) for x in r])
    assert seq["linear"][4:15] == pytest.approx([lo + (1 - x) * (lr - lo) for x in r])
    assert seq["linear"][9] == pytest.approx(0.55) and seq["cosine"][9] == pytest.approx(0.55)   # half-way
    for s in ("cosine", "linear"):
        assert seq[s][4] == 1.0 and seq[s][14:] == [lo] * 6 and all(np.diff(seq[s][4:]) <= 0)


def test_decay_steps_zero_means_the_whole_run():
    cfg = C.loads('[train]\nsteps = 50\n[optim]\nlr = 0.5\nschedule = "linear"\nwarmup_steps = 5\nlr_min = 0.1\n')
    f = S.for_config(cfg)
    assert [f(it) for it in range(60)] == [S.lr_at(it, 0.5, "linear", 5, 50, 0.1) for it in range(60)]
    assert f(49) > 0.1 and f(50) == pytest.approx(0.1) and S.describe(cfg) == "linear lr 0.5 -> 0.1 by step 50, warmup 5"


# ---- in `btjit train` ------------------------------------------------------------------------------------
SCHED = tiny_config(steps=30, checkpoint_interval=3, keep_checkpoints=20) + \
    'schedule = "cosine"\nwarmup_steps = 10\ndecay_steps = 26\nlr_min = 0.002\n'


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def test_each_steps_lr_is_set_before_the_native_step_and_logged(tmp_path, monkeypatch):
    import btjit.core.program
    cfg, data, tmp = write_run_files(tmp_path, SCHED, corpus())
    seen, real = [], btjit.core.program.Program.step

    def step(self, *batch):
        seen.append(self.lr)
        return real(self, *batch)
    monkeypatch.setattr(btjit.core.program.Program, "step", step)
    res = run("train", cfg, "--data", data, "--out", tmp / "a")
    assert res.exit_code == 0, res.output
    want = [float(np.float32(S.lr_at(it, 0.02, "cosine", 10, 26, 0.002))) for it in range(30)]
    assert seen == want
    assert "optim: adamw cosine lr 0.02 -> 0.002 by step 26, warmup 10" in res.output
    for e in events(tmp / "a", "train"):                  # the LR of the last step before the line
        assert e["lr"] == want[e["step"] - 1]
        assert f"step {e['step']:>2}/30" in res.output and f"| lr {want[e['step'] - 1]:.3g} |" in res.output


def final(run_dir):
    ck, skipped = K.latest_valid(run_dir)
    assert not skipped
    return ck


def assert_same(a, b):
    assert a.step == b.step and set(a.state) == set(b.state) and a.meta["rng_state"] == b.meta["rng_state"]
    for k in a.state:
        assert np.array_equal(a.state[k], b.state[k]), k


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_mid_warmup_and_mid_decay_is_bit_exact(tmp_path, monkeypatch, accum):
    from btjit.train.trainer import Trainer
    cfg, data, tmp = write_run_files(tmp_path, SCHED, corpus())
    acc = ("--set", f"train.grad_accum={accum}")
    assert run("train", cfg, "--data", data, "--out", tmp / "a", *acc).exit_code == 0
    # mid-warm-up: Ctrl+C's path (finish the step, save, exit) at step 7 of the 10 warm-up steps
    real = Trainer._stop_requested
    monkeypatch.setattr(Trainer, "_stop_requested", lambda self, stop: self.step == 7 or real(self, stop))
    res = run("train", cfg, "--data", data, "--out", tmp / "w", *acc)
    assert res.exit_code == 0 and "interrupted at step 7" in res.output, res.output
    monkeypatch.setattr(Trainer, "_stop_requested", real)
    res = run("train", cfg, "--data", data, "--out", tmp / "w", "--resume", *acc)
    assert res.exit_code == 0 and "resumed from ckpt_00000007.npz at step 7" in res.output, res.output
    assert_same(final(tmp / "a"), final(tmp / "w"))
    # mid-decay: a run killed after its step-18 checkpoint (the later files gone), resumed
    shutil.copytree(tmp / "a", tmp / "d")
    for p in K.list_checkpoints(tmp / "d"):
        if K.load(p).step > 18:
            p.unlink()
    (tmp / "d" / K.BEST).unlink()
    res = run("train", cfg, "--data", data, "--out", tmp / "d", "--resume", *acc)
    assert res.exit_code == 0 and "resumed from ckpt_00000018.npz at step 18" in res.output, res.output
    assert_same(final(tmp / "a"), final(tmp / "d"))
    assert [e["lr"] for e in events(tmp / "d", "train")] == [e["lr"] for e in events(tmp / "a", "train")]
    assert_same(K.load(tmp / "a" / K.BEST), K.load(tmp / "d" / K.BEST))


def test_grad_accum_draws_k_micro_batches_and_counts_their_tokens(tmp_path):
    from btjit.train.trainer import Trainer, seeds
    cfg_path, data, tmp = write_run_files(tmp_path, SCHED, corpus())
    cfg = C.load(cfg_path, ["train.grad_accum=3", "train.steps=12"])
    lines = []
    tr = Trainer(cfg, tmp / "g", data_path=data, echo=lines.append)
    assert tr.tokens_per_step == 3 * 4 * 4                # 3 micro-batches of 4 sequences of 4 tokens
    tr.run()
    assert any("| batch 4 x 3 micro-batches = 12 |" in l for l in lines), lines
    rng = seeds(7)[1]
    for _ in range(12 * 3):                               # 12 updates drew 36 batches of 4
        tr.ds.batch("train", 4, rng)
    assert final(tmp / "g").meta["rng_state"] == K.rng_state(rng)


# ---- accumulation == the big batch (float64) -------------------------------------------------------------
def tiny_gpt(batch, opt, clip, rng_seed=0):
    mcfg = gpt.GPTConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=8, block_size=4)
    params = gpt.init_params(mcfg, np.random.default_rng(rng_seed))
    x = np.zeros((batch, 4), np.int32)
    return btjit.trace(gpt.loss_fn(mcfg), params, x, x, optimizer=opt, clip_norm=clip, dtype="float64")


OPTS = {"sgd": (lambda: btjit.optim.SGD(lr=0.3, momentum=0.9, weight_decay=0.01), None),
        "adamw": (lambda: btjit.optim.AdamW(lr=0.05, weight_decay=0.1), 0.5)}


def micro_batches(rng, k, b):
    x = rng.integers(0, 11, (k * b, 4)).astype(np.int32)
    y = rng.integers(0, 11, (k * b, 4)).astype(np.int32)
    return x, y, [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(k)]


@pytest.mark.parametrize("name", list(OPTS))
def test_accumulated_micro_batches_equal_one_big_batch_step(name):
    make, clip = OPTS[name]
    k, b = 3, 2
    small, big = tiny_gpt(b, make(), clip), tiny_gpt(k * b, make(), clip)
    acc, rng = S.Accumulator(small), np.random.default_rng(5)
    for _ in range(4):                                    # several updates: the optimizer state too
        x, y, parts = micro_batches(rng, k, b)
        l_small, l_big = acc.step(parts), big.step(x, y)
        assert l_small == pytest.approx(l_big, rel=1e-12)
        for p in big.params:
            np.testing.assert_allclose(small.params[p], big.params[p], rtol=1e-10, atol=1e-13, err_msg=p)
    one = tiny_gpt(b, make(), clip)                       # k = 1: value_and_grad + apply_update == step()
    one.load_state_dict(small.state_dict())
    assert acc.step(parts[:1]) == one.step(*parts[0])
    for p in one.params:
        assert np.array_equal(small.params[p], one.params[p]), p


def test_data_parallel_accumulates_like_one_process(monkeypatch):
    """DataParallel.step_batches on one rank (a stand-in communicator: MPI is not needed for one rank) gives
    the big-batch step too: the distributed path runs the same accumulation before its one Allreduce."""
    from btjit.train import distributed

    class OneRank:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

        def Allreduce(self, send, recv=None, op=None):  # in place on one rank: nothing to add
            pass

        def Bcast(self, buf, root=0):
            pass
    fake = types.SimpleNamespace(COMM_WORLD=OneRank(), IN_PLACE=object(), SUM=object())
    monkeypatch.setattr(distributed, "require_mpi", lambda: fake)
    make, clip = OPTS["adamw"]
    dp, big = distributed.DataParallel(tiny_gpt(2, make(), clip)), tiny_gpt(6, make(), clip)
    rng = np.random.default_rng(9)
    for _ in range(3):
        x, y, parts = micro_batches(rng, 3, 2)
        assert dp.step_batches(parts) == pytest.approx(big.step(x, y), rel=1e-12)
    for p in big.params:
        np.testing.assert_allclose(dp.prog.params[p], big.params[p], rtol=1e-10, atol=1e-13, err_msg=p)


def test_step_schedule_is_torchs_steplr():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    want = []
    for _ in range(40):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    cfg = C.loads('[train]\nsteps = 40\n[optim]\nlr = 1.0\nschedule = "step"\nstep_size = 7\ngamma = 0.7\n')
    f = S.for_config(cfg)
    assert [f(it) for it in range(40)] == pytest.approx(want, rel=1e-15)
    assert S.describe(cfg) == "step lr 1, x 0.7 every 7 steps"
    warm = [S.lr_at(it, 1.0, "step", 3, 0, 0.0, 0.5, 2) for it in range(9)]     # counted from the warm-up's end
    assert warm == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25])


@pytest.mark.parametrize("keys, what", [('schedule = "step"\n', "optim.step_size >= 1"),
                                        ('schedule = "step"\nstep_size = 5\ngamma = 0.0\n', "optim.gamma = 0")])
def test_step_schedule_errors_name_the_key(keys, what):
    with pytest.raises(C.ConfigError, match=what):
        C.loads("[optim]\n" + keys)
