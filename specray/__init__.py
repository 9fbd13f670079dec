"""specray: speculative decoding on Ray.

The code lives in root folders mapped to subpackages (see pyproject.toml):
``specray.kernels``, ``specray.policies``, ``specray.engine``, ``specray.protocol``,
``specray.actors``, ``specray.serve``, ``specray.entrypoints``, ``specray.training``,
``specray.bench``, ``specray.demo`` (README, "Layout").
"""

__version__ = "0.1.0"
