"""specray: speculative decoding on Ray.

The code lives in root folders mapped to subpackages (see pyproject.toml):
``specray.kernels``, ``specray.policies``, ``specray.engine``, ``specray.demo``,
``specray.cluster``, ``specray.bench``.
"""

__version__ = "0.1.0"
