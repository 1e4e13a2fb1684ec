"""Input checks shared by the reward formulas."""

from __future__ import annotations

import numpy as np


def unit_interval(v: object, name: str) -> np.ndarray:
    """``v`` as a float64 array with every value finite and in [0, 1]; ``ValueError`` naming ``name`` if not."""
    arr = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"{name} must be a number or an array of numbers in [0, 1], got {v!r}")
    arr = arr.astype(np.float64)
    if not (np.isfinite(arr).all() and (arr >= 0).all() and (arr <= 1).all()):
        raise ValueError(f"{name} must be in [0, 1], got {v!r}")
    return arr


def unit_number(v: object, name: str) -> float:
    """A plain number in [0, 1]; ``ValueError`` naming ``name`` if not."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)
