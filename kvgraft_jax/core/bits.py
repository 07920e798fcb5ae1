"""Bit-level comparison: exactness is asserted on raw bits, never with a tolerance."""

from __future__ import annotations

import hashlib

import jax
import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def as_bits(x) -> np.ndarray:
    """The array's bits as unsigned integers of the same width (bf16 -> uint16, f32 -> uint32)."""
    value = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    return value.view(_UINT[value.dtype.itemsize])


def sha256(x) -> str:
    value = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    return hashlib.sha256(value.tobytes()).hexdigest()


def first_mismatch(a, b) -> tuple[int, ...] | None:
    """Index of the first element whose bits differ, or None when bit-identical."""
    a_bits, b_bits = as_bits(a), as_bits(b)
    if a_bits.shape != b_bits.shape or a_bits.dtype != b_bits.dtype:
        raise ValueError(
            f"cannot compare {a_bits.dtype}{a_bits.shape} with {b_bits.dtype}{b_bits.shape}"
        )
    diff = np.argwhere(a_bits != b_bits)
    return tuple(int(i) for i in diff[0]) if diff.size else None


def bits_equal(a, b) -> bool:
    return first_mismatch(a, b) is None
