"""Tier: pure (torch only). A rebound function reads its own ``torch``; nothing else changes."""

import types

import pytest
import torch

from megatron_ext.compat.host_torch import HostTorch, innermost_function, rebind

SOURCE = """
import functools

import torch

def named():
    return torch.cuda.current_device(), [torch.zeros(1, device="cuda") for _ in range(1)][0].device

def unrelated():
    return torch.cuda.current_device()

def decorate(f):
    @functools.wraps(f)
    def wrapper(*a):
        return f(*a)
    return wrapper

@decorate
def decorated():
    return torch.cuda.current_device()

class Holder:
    torch = None
    def attribute_named_torch(self):
        return self.torch
"""


def _module() -> types.ModuleType:
    module = types.ModuleType("fake_megatron")
    module.__file__ = "<fake_megatron>"
    exec(compile(SOURCE, module.__file__, "exec"), vars(module))
    return module


def _rebind(module: types.ModuleType, function: types.FunctionType, host: HostTorch) -> None:
    vars(module)["_alias"] = host.proxy()
    rebind(function, "_alias")


def test_only_the_named_function_sees_the_host_calls() -> None:
    module = _module()
    _rebind(module, module.named, HostTorch(cuda=("current_device",), factories=True))
    # The named body and the comprehension nested in it: the host.
    assert module.named() == ("cpu", torch.device("cpu"))
    assert module.torch is torch  # the module's own global is Megatron's torch
    if not torch.cuda.is_available():  # the same call one function over still goes to CUDA
        with pytest.raises((RuntimeError, AssertionError)):
            module.unrelated()


def test_a_decorated_function_is_rebound_at_its_body() -> None:
    module = _module()
    body = innermost_function(module.decorated, module.__file__)
    assert body is module.decorated.__wrapped__  # the wrapper is of the same file, not the body
    _rebind(module, body, HostTorch(cuda=("current_device",)))
    assert module.decorated() == "cpu"


def test_torch_used_other_than_as_a_global_is_refused() -> None:
    module = _module()
    with pytest.raises(RuntimeError, match="uses 'torch' in LOAD_ATTR"):
        rebind(module.Holder.attribute_named_torch, "_alias")


def test_unknown_cuda_name_and_untouched_names() -> None:
    with pytest.raises(AssertionError, match="no CPU stand-in"):
        HostTorch(cuda=("no_such_call",))
    proxy = HostTorch(cuda=("synchronize",)).proxy()
    assert proxy.cuda.synchronize() is None
    assert proxy.cuda.is_available is torch.cuda.is_available  # falls through
    assert proxy.zeros is torch.zeros  # factories only when asked for
