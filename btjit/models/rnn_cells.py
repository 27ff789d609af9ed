"""LSTM and GRU cells written with btjit's tensor API, with torch.nn.LSTMCell / GRUCell's weights, gate order
and semantics, so a torch state_dict's weight_ih / weight_hh / bias_ih / bias_hh load as they are:

    h, c = lstm_cell(x, h, c, p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"])   # (B, H) each
    h = gru_cell(x, h, p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"])
    ys, (h, c) = lstm(xs, (h, c), *weights)            # torch.nn.LSTM's one layer over xs (T, B, I)

x (B, I), h and c (B, H); weight_ih (G*H, I), weight_hh (G*H, H), biases (G*H,) or None (torch's bias=False),
G = 4 gates for the LSTM (input, forget, cell, output), 3 for the GRU (reset, update, new). The two products
are GEMMs; everything after them -- the gate slices, sigmoids, tanhs and the state update -- is elementwise and
becomes one fused row forward and one backward (graph/fuse_ew.py reads the gate slices in place and writes the
gates' gradient into one array).
"""
from __future__ import annotations


def _proj(x, w, b):
    """x @ w^T (+ b): torch's Linear with weight (out, in)."""
    return x @ w.T if b is None else x @ w.T + b


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.nn.LSTMCell: gates i, f, g, o = x W_ih^T + b_ih + h W_hh^T + b_hh; c' = sigmoid(f) c +
    sigmoid(i) tanh(g); h' = sigmoid(o) tanh(c'). Returns (h', c')."""
    return _lstm_step(_proj(x, w_ih, b_ih), h, c, w_hh, b_hh)


def _lstm_step(xw, h, c, w_hh, b_hh):
    """lstm_cell from the input's projection xw = x W_ih^T + b_ih."""
    import btjit
    i, f, g, o = btjit.split(xw + _proj(h, w_hh, b_hh), 4, axis=-1)     # (B, H) each
    c2 = btjit.sigmoid(f) * c + btjit.sigmoid(i) * btjit.tanh(g)
    return btjit.sigmoid(o) * btjit.tanh(c2), c2


def gru_cell(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.nn.GRUCell: r = sigmoid(x_r + h_r), z = sigmoid(x_z + h_z), n = tanh(x_n + r h_n),
    h' = (1 - z) n + z h, where x_* and h_* are the gates of x W_ih^T + b_ih and h W_hh^T + b_hh. Returns h'."""
    return _gru_step(_proj(x, w_ih, b_ih), h, w_hh, b_hh)


def _gru_step(xw, h, w_hh, b_hh):
    """gru_cell from the input's projection xw = x W_ih^T + b_ih."""
    import btjit
    xr, xz, xn = btjit.split(xw, 3, axis=-1)       # (B, H) each
    hr, hz, hn = btjit.split(_proj(h, w_hh, b_hh), 3, axis=-1)
    r = btjit.sigmoid(xr + hr)
    z = btjit.sigmoid(xz + hz)
    n = btjit.tanh(xn + r * hn)
    return (1.0 - z) * n + z * h


def _steps_proj(xs, w, b):
    """The projection x W^T + b of every step of xs (T, B, I), as one product: (T, B, G*H)."""
    T, B, I = xs.shape
    return _proj(xs.reshape(T * B, I), w, b).reshape(T, B, w.shape[0])


def lstm(xs, state, w_ih, w_hh, b_ih=None, b_hh=None):
    """One layer of torch.nn.LSTM (batch_first=False): xs (T, B, I), state (h, c) each (B, H) ->
    (outputs (T, B, H), (h, c) after the last step). The loop unrolls into the graph, T cells; the input's
    projection is one product over the T steps (as torch's CPU LSTM), only h's is made step by step."""
    import btjit
    h, c = state
    ys, xw = [], _steps_proj(xs, w_ih, b_ih)
    for t in range(xs.shape[0]):
        h, c = _lstm_step(xw[t], h, c, w_hh, b_hh)
        ys.append(h)
    return btjit.stack(ys), (h, c)


def gru(xs, h, w_ih, w_hh, b_ih=None, b_hh=None):
    """One layer of torch.nn.GRU (batch_first=False): xs (T, B, I), h (B, H) -> (outputs (T, B, H), h), the
    input's projection made for all T steps at once as in lstm."""
    import btjit
    ys, xw = [], _steps_proj(xs, w_ih, b_ih)
    for t in range(xs.shape[0]):
        h = _gru_step(xw[t], h, w_hh, b_hh)
        ys.append(h)
    return btjit.stack(ys), h
