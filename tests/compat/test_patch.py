"""Tier: Megatron on one rank (its modules patched and restored in this process).

``compat.patched`` applies the table's rows for a block and puts every Megatron attribute and
function body back on exit; only the named functions change: any other CUDA call in a patched
Megatron module still goes to CUDA (and fails on a CPU-only machine).
"""

import importlib

import pytest
import torch

from megatron_ext import compat
from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Patch

GROUPS = ("cpu", "cpu_loop", "launch", "validate_on_target", "fp4_rehearsal", "dry_run_target")


def _state(rows: list[Patch]) -> dict[str, object]:
    """What each row changes: a function's code, or the attribute's value."""
    state: dict[str, object] = {}
    for row in rows:
        owner = importlib.import_module(row.module)
        *path, name = row.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        value = owner.__dict__.get(name)
        if isinstance(row.replacement, HostTorch):
            value = getattr(value, "__func__", value)
            while getattr(value, "__wrapped__", None) is not None:
                value = value.__wrapped__
            state["code " + row.name] = value.__code__
        else:
            state[row.name] = value
    return state


def test_patched_applies_every_row_and_restores_everything() -> None:
    rows = compat.rows(*GROUPS)
    before = _state(rows)
    with compat.patched(*GROUPS) as done:
        assert done, "every row was applied already: nothing to prove"
        during = _state(done)
        assert all(during[key] is not before[key] for key in _state(done))
        assert all(compat.applied(row) for row in rows)
    after = _state(rows)
    assert all(after[key] is before[key] for key in before)
    assert not any(compat.applied(row) for row in done)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the unrelated call must fail without CUDA")
def test_an_unrelated_cuda_call_in_a_patched_module_still_fails_on_cpu() -> None:
    from megatron.core.transformer.moe import router

    namespace = vars(router)
    # A function of the same module the table does not name: it reads Megatron's global torch.
    exec("def unrelated_call():\n    return torch.cuda.current_device()\n", namespace)
    try:
        with compat.patched("cpu"):
            gating = router.Router.gating.__code__
            alias = next(n for n in gating.co_names if n.startswith("_megatron_ext_torch"))
            assert namespace[alias].cuda.current_device() == "cpu"  # the named call site
            assert router.torch is torch  # the module's torch is untouched
            with pytest.raises((RuntimeError, AssertionError), match="NVIDIA|CUDA|compiled"):
                namespace["unrelated_call"]()
    finally:
        del namespace["unrelated_call"]


def test_applying_twice_changes_nothing_and_a_replaced_attribute_is_reapplied(monkeypatch) -> None:
    from megatron.training import training

    row = compat.row("megatron.training.training.training_log")
    with compat.patched("launch"):
        wrapped = training.training_log
        assert compat.apply("launch") == []  # idempotent
        assert training.training_log is wrapped

        def training_log(iteration: int, is_first_iteration: bool = False) -> None:
            del iteration, is_first_iteration

        monkeypatch.setattr(training, "training_log", training_log)
        assert not compat.applied(row)  # a test replaced it: applying again wraps the new one
        assert compat.apply_rows([row]) == [row]
        assert training.training_log.__wrapped__ is training_log
