"""Checkpoints, model math (pure torch, no Ray), the in-process reference model and the expert actor."""

import os

# Bit-exact across processes means the same bits whatever thread count each process computes with: the router and
# the in-process reference run on the process's threads, each expert actor on the cores Ray gave it. MKL's sgemm
# (torch's float32 matmul on CPU) splits a product differently per thread count (a [12, 32] x [32, 96] product gave
# last-bit differences at 2 threads against 1), unless its strict conditional-numerical-reproducibility mode is on;
# measured no slower here (sgemm 256 x 1024 x 4096 and gemv, 2 threads). MKL reads this at its first call, so it is
# set before any of our math runs (every process that computes imports this package first); a value the user set
# is kept. The rest of what makes a row's bits independent of its call: experts/reproducible.py.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
