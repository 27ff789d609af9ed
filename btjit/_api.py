"""btjit's public API (what `import btjit` exposes), imported on first use by btjit/__init__.py so that
`import btjit.runtime` -- an exported program, ctypes and numpy only -- never loads numba."""
from btjit import optim
from btjit.host import threads
from btjit.graph.functional import (binary_cross_entropy, binary_cross_entropy_with_logits, cross_entropy, elu,
                                    embedding, gelu, group_norm, hardtanh, instance_norm, l1_loss, layer_norm,
                                    leaky_relu, log_softmax, logsumexp, mse_loss, nll_loss, one_hot, relu6, silu,
                                    smooth_l1_loss, softmax, softplus)
from btjit.graph.trace import (TraceError, abs, arange, broadcast_to, concatenate, copy, equal, erf, exp, log, log1p,
                               matmul, maximum, mean, minimum, relu, reshape, sigmoid, sin, cos, split, sqrt,
                               stop_gradient, sum, swapaxes, tanh, transpose, where)
from btjit.graph.indexing import setitem, take
from btjit.graph.numpy_fns import (_torch_dims, argmax, argmin, clip, expand_dims, extremum, flip, full_like, moveaxis,
                                   outer, prod, roll, sign, squeeze, stack, std, take_along_axis, tile, var)
from btjit.graph.numpy_more import logaddexp, ones_like, tril, triu, zeros_like
from btjit.graph.sort_fns import (argsort, ceil, cumprod, cumsum, diff, floor, floor_divide, fmod,  # noqa: A004
                                  remainder, round, sort, topk, trunc)
from btjit.graph.rng import (bernoulli, causal_attention, dropout, dropout2d, rand, rand_like,  # noqa: F811 -- dropout=
                             randn, randn_like, scaled_dot_product_attention)
from btjit.graph.conv_fns import (adaptive_avg_pool1d, adaptive_avg_pool2d, adaptive_max_pool1d, adaptive_max_pool2d,
                                  avg_pool1d, avg_pool2d, conv1d, conv2d, conv_transpose1d, conv_transpose2d, flatten,
                                  max_pool1d, max_pool2d, pad)
from btjit.graph.torch_fns import (cat, celu, cosine_similarity, einsum, glu, hardsigmoid, hardswish, huber_loss,
                                   kl_div, linear, logsigmoid, mish, normalize, prelu, repeat_interleave, rsqrt, selu,
                                   softsign, unbind)
from btjit.graph.torch_losses import (cosine_embedding_loss, gaussian_nll_loss, hardshrink, hinge_embedding_loss,
                                     margin_ranking_loss, pairwise_distance, poisson_nll_loss, soft_margin_loss,
                                     softshrink, tanhshrink, triplet_margin_loss)
from btjit.graph.vision_fns import (channel_shuffle, fold, interpolate, local_response_norm, lp_pool1d, lp_pool2d,
                                    pixel_shuffle, pixel_unshuffle, unfold)
from btjit.core.program import Program
from btjit.core.tracing import trace
from btjit.scalar.front import trace_scalar
from btjit.host.threads import replicas_for, set_num_threads
from btjit.graph.state import assign, is_training
from btjit.graph.ops.batchnorm import batch_norm

argmax, argmin, prod = (_torch_dims(f) for f in (argmax, argmin, prod))   # axis= or dim=
max, min = extremum(1.0), extremum(-1.0)   # noqa: A001 -- as x.max / x.min: torch's (values, indices) with dim=
