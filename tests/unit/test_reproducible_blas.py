"""Float32 products on CPU give the same bits at any thread count once `expertmesh.experts` is imported (it turns on
MKL's strict reproducibility mode, experts/__init__.py): the router, the reference and each expert actor compute
with different thread counts, and "distributed == reference bit for bit" depends on it. Run in a fresh interpreter,
since MKL reads the mode once, at its first call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

PROGRAM = """
import torch
{import_line}
torch.manual_seed(0)
w = torch.randn(96, 32)  # [N, K]
x = torch.randn(46, 32)  # [M, K]: rows the way an expert call gets them
out = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    out.append(torch.cat([torch.nn.functional.linear(rows, w) for rows in x.split([12, 11, 13, 10])]))
print("equal" if torch.equal(out[0], out[1]) else "differ")
"""


def _run(program: str) -> str:
    """What `program` prints, run in a fresh interpreter with no MKL_CBWR of ours in its environment."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_products_give_the_same_bits_at_one_and_two_threads_after_importing_experts():
    assert _run(PROGRAM.format(import_line="import expertmesh.experts")) == "equal"


@pytest.mark.skipif(not torch.backends.mkl.is_available() or (os.cpu_count() or 1) < 2,
                    reason="torch built without MKL, or one core")
def test_without_the_mode_this_product_does_depend_on_threads():
    """The control: without the import the same program differs on this box's MKL, so the test above tests
    something. Another CPU's MKL kernels may happen to agree for this shape; then there is nothing to show."""
    if _run(PROGRAM.format(import_line="")) == "equal":
        pytest.skip("this CPU's MKL gives the same bits at 1 and 2 threads for this product even without the mode")


ROWS_PROGRAM = """
import torch
from expertmesh.experts.reproducible import padded_linear
torch.manual_seed(0)
w = torch.randn(96, 32)  # [N, K]
bad = 0
for threads in (1, 2):
    torch.set_num_threads(threads)
    for m in (1, 2, 3, 5, 9, 17):
        x = torch.randn(m, 32)  # [M, K]
        whole = padded_linear(x, w)
        bad += sum(not torch.equal(padded_linear(x[s:e].clone(), w), whole[s:e])
                   for s in range(m) for e in range(s + 1, m + 1))
print(bad)
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_a_rows_bits_do_not_depend_on_how_many_rows_share_its_product():
    """Every range of rows computed on its own equals the same rows inside the whole product, at 1 and 2 threads:
    MKL computes products of 1-3 rows with other kernels, so padded_linear never gives it fewer than 4."""
    assert _run(ROWS_PROGRAM) == "0"
