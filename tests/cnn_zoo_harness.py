"""The harness of tests/test_cnn_zoo*.py: a net's building blocks as users call them on btjit (under its torch
state_dict's names), and run_against_torch, which trains a btjit net beside its torch twin and compares them."""
import numpy as np
import torch

import btjit

F = torch.nn.functional
TOL = {"float64": 1e-10, "float32": 1e-4}


def bn(p, x, name):                  # nn.BatchNorm*d as the user calls it, its state_dict's names
    return btjit.batch_norm(x, p[name + ".weight"], p[name + ".bias"], p[name + ".running_mean"],
                            p[name + ".running_var"])


def linear(p, x, name):              # nn.Linear: weight (out, in)
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def conv(p, x, name, **kw):
    return btjit.conv2d(x, p[name + ".weight"], p.get(name + ".bias"), **kw)


def close(got, want, tol, what):
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def run_against_torch(net, loss, shape, classes=10, dtype="float64", opt="sgd", steps=5, B=4, seed=0, nhwc=False,
                      pixels=False):
    """net: a torch nn.Module; loss(p, x, y): the same net in btjit over net's state_dict names. Trains both for
    `steps` steps on the same batches, comparing the loss and every gradient at each step, then the params,
    the running statistics and the eval-mode loss."""
    torch.manual_seed(seed)
    tdt = getattr(torch, dtype)
    net = net.to(tdt).train()
    rng = np.random.default_rng(seed)
    data = [(rng.normal(size=(B,) + shape).astype(dtype),
             rng.integers(0, classes, (B,) + (shape[1:] if pixels else ())).astype(np.int32)) for _ in range(steps + 1)]
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    bufs = {k: v.numpy().copy() for k, v in net.named_buffers() if not k.endswith("num_batches_tracked")}
    if opt == "sgd":
        topt, bopt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), btjit.optim.SGD(0.05, momentum=0.9)
    else:
        topt, bopt = torch.optim.Adam(net.parameters(), lr=1e-3), btjit.optim.Adam(1e-3)
    prog = btjit.trace(loss, params, *data[0], optimizer=bopt, dtype=dtype, buffers=bufs)
    tol = TOL[dtype]

    def tloss(x, y):
        xt = torch.tensor(x)
        if nhwc:                     # (torch's conv of a permuted 1-channel image is channels-last: .view fails)
            xt = xt.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
        return F.cross_entropy(net(xt), torch.tensor(y).long())
    for x, y in data[:steps]:
        topt.zero_grad()
        want = tloss(x, y)
        want.backward()
        got = prog.step(x, y)
        close(got, want.item(), tol, "loss")
        for k, v in net.named_parameters():
            close(prog.grads[k], v.grad.numpy(), tol * 10, "grad " + k)
        topt.step()
    for k, v in net.named_parameters():
        close(prog.params[k], v.detach().numpy(), tol * 10, k)
    for k in bufs:
        close(prog.buffers[k], dict(net.named_buffers())[k].numpy(), tol * 10, k)
    net.eval()
    with torch.no_grad():
        want = tloss(*data[steps]).item()
    close(prog.eval(*data[steps]), want, tol * 10, "eval loss")
    return prog
