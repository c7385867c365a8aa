"""``torch.nn.functional`` for tapeflow: ``import tapeflow.nn.functional as F``.

Every function takes PyTorch's arguments and layouts and returns what PyTorch
returns; each is an entry of the surface table (``tapeflow/_shell/_surface.py``),
where it is declared with how it records.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> import tapeflow.nn.functional as F
>>> with tfl.Session() as s:
...     F.relu(s.input(jnp.array([-1.0, 2.0]))).tolist()
[0.0, 2.0]
"""

from .._shell._torch_functional import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    avg_pool1d,
    avg_pool2d,
    conv1d,
    conv2d,
    conv_transpose2d,
    dropout,
    embedding,
    group_norm,
    layer_norm,
    linear,
    max_pool1d,
    max_pool2d,
    relu,
    rms_norm,
    scaled_dot_product_attention,
)

__all__ = [
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "avg_pool1d",
    "avg_pool2d",
    "conv1d",
    "conv2d",
    "conv_transpose2d",
    "dropout",
    "embedding",
    "group_norm",
    "layer_norm",
    "linear",
    "max_pool1d",
    "max_pool2d",
    "relu",
    "rms_norm",
    "scaled_dot_product_attention",
]
