"""labkit.device: the automatic choice and the LABKIT_DEVICE override."""
from __future__ import annotations

import pytest
import torch

from labkit.device import describe, device_name, get_device, synchronize


def test_override_to_cpu(monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")


@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_automatic_choice_is_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert get_device().type == expected


@pytest.mark.parametrize("name, message", [("banana", "is not a device"), ("meta", "runs on cpu, cuda or mps")])
def test_bad_names_are_refused_with_the_name(monkeypatch, name, message):
    monkeypatch.setenv("LABKIT_DEVICE", name)
    with pytest.raises(ValueError, match=f"LABKIT_DEVICE='{name}'.*{message}"):
        get_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "cuda")
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        get_device()


def test_names_and_report():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert device_name("cpu").startswith("cpu (") and device_name("cpu").endswith(", 1 thread)")
        assert "thread" not in device_name("cpu", threads=False)  # work in other processes: their own threads
    finally:
        torch.set_num_threads(threads)
    synchronize("cpu")
    info = describe()
    assert info["torch"] == torch.__version__
    assert set(info) >= {"python", "torch", "triton", "device", "device name"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_device_argument_is_checked_as_the_variable_is_and_named_as_an_argument():
    from labkit.load import load

    with pytest.raises(ValueError, match="device='cuda' but torch .* sees no CUDA GPU; use 'cpu'"):
        load("draft", "cuda")  # torch's own error is an AssertionError from deep inside
    with pytest.raises(ValueError, match="device='banana' is not a device"):
        load("draft", "banana")
    with pytest.raises(ValueError, match="dtype='float16' must be a torch dtype"):
        load("draft", "cpu", "float16")
