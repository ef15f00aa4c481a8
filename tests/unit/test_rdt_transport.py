"""The `rdt` transport's checks that need no Ray session: its name is a transport every entry point accepts, and it
refuses to start where NIXL is missing, naming the field and the package (tests/integration/test_transports.py runs
it; tests/integration/test_rdt_limits.py pins why it is built on NIXL)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.router_service.transports import rdt
from expertmesh.router_service.transports.base import TRANSPORT_SETTINGS, check_transport


def test_rdt_is_a_transport_name():
    assert "rdt" in TRANSPORT_SETTINGS and check_transport("rdt") == "rdt"


def test_the_rdt_transport_refuses_to_start_without_nixl(monkeypatch):
    monkeypatch.setattr(rdt, "rdt_available", lambda: False)
    with pytest.raises(ValueError, match=r"transport: 'rdt' .*nixl") as err:
        rdt.RdtTransport({})
    assert "expertmesh[rdt]" in str(err.value)


def test_rdt_available_answers_whether_nixl_imports(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nixl(name, *args, **kwargs):
        if name.startswith("nixl"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    assert rdt.rdt_available() is False


def test_an_empty_tensor_travels_itself_since_nixl_cannot_register_zero_bytes():
    """Seen in `bench dispatch`'s empty round: a NIXL read of a 0-row tensor fails ("no specified or potential
    backend had the required registrations"), so rdt_box sends empty rows and outputs as themselves."""
    from expertmesh.experts.rdt_box import rdt_box, rdt_box_rows, rdt_read, rdt_reading

    empty = torch.zeros(0, 8, dtype=torch.bfloat16)
    boxed = rdt_box(empty)
    assert isinstance(boxed, torch.Tensor) and boxed.shape == (0, 8) and boxed.dtype == torch.bfloat16
    rows, give_back = rdt_box_rows(empty)
    assert isinstance(rows, torch.Tensor) and rows.shape == (0, 8)
    give_back()
    assert rdt_read([boxed], "cpu")[0] is boxed
    with rdt_reading(boxed, "cpu") as read:
        assert read is boxed
