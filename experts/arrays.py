"""Moving tensors across Ray as numpy arrays, which Ray passes zero-copy through its object store."""

from __future__ import annotations

import warnings

import numpy as np
import torch


def readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """Wrap an array from Ray's object store (a read-only, zero-copy view) without copying; callers never write."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(array)
