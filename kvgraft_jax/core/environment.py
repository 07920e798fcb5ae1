"""What this process computes with, beyond the weights: package versions, backend and XLA flags.

Both are part of the exactness contract (`exact/contract.py`): a deposit records them, and a
verify says which differ, since a different XLA or flag set may compile a different program.
"""

from __future__ import annotations

import os
import platform

import jax

from kvgraft_jax.core import xla_flags as xla_flags_lib


def versions() -> dict[str, str]:
    import flax
    import gemma
    import jaxlib
    import orbax.checkpoint

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "gemma": getattr(gemma, "__version__", "unknown"),
        "orbax_checkpoint": orbax.checkpoint.__version__,
        "backend": jax.default_backend(),
    }


def xla_flags() -> str:
    """This process's `XLA_FLAGS`, normalised (`xla_flags.normalize`)."""
    return xla_flags_lib.normalize(os.environ.get("XLA_FLAGS", ""))
