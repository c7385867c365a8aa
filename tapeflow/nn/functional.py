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

from .._shell._torch_functional import relu

__all__ = ["relu"]
