"""Tier: Megatron on one rank (no process group): the resume checks' pairing of saved optimizer
param groups after an LR change, and the LR changes it cannot pair, refused at startup. Megatron is
imported inside the tests, not at collection (its import sets TORCHINDUCTOR_CACHE_DIR, and a
launch forks its ranks only under the session's environment).

Megatron 0.19.2 keys a param group by its hyperparameters, ``max_lr``/``min_lr`` (the run's
``--lr``/``--min-lr``) included, so a resume with another ``--lr`` finds no saved group; 0.18.2
keys them without and pairs them, but the groups keep the checkpoint's LR. The real resume (two
gloo ranks, the Adam moments compared) is in tests/training/test_startup_refusals.py.
"""

import argparse
from typing import Any

import pytest

from megatron_ext.compat import row
from megatron_ext.compat.patch import original
from megatron_ext.training.resume_checks import (
    check_lr_change,
    groups_keyed_by_lr,
    matching_groups_across_lr,
    megatron_args,
)

pytestmark = pytest.mark.each_megatron

NAME = "megatron.core.optimizer.optimizer.MegatronOptimizer._filter_and_reorder_param_groups"


def _megatrons() -> Any:
    """Megatron's own pairing (the row's original), looked up inside a test (see above)."""
    return original(row(NAME))


def _group(params: list[int], lr: float, *, wd_mult: float = 1.0, expert: bool = False) -> dict:
    """A param group as Megatron's ``_get_param_groups`` builds it (and a saved one holds)."""
    return {"params": params, "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False,
            "is_expert_parallel": expert, "max_lr": lr, "min_lr": 0.0, "betas": (0.9, 0.999)}  # fmt: skip


def _saved_and_current(saved_lr: float, lr: float) -> tuple[list[dict], list[dict]]:
    # Three groups (decayed, not decayed, expert); the saved ones hold state indices 0..5.
    saved = [_group([0, 1], saved_lr), _group([2], saved_lr, wd_mult=0.0),
             _group([3, 4, 5], saved_lr, expert=True)]  # fmt: skip
    current = [_group(["w0", "w1"], lr), _group(["b"], lr, wd_mult=0.0),
               _group(["e0", "e1", "e2"], lr, expert=True)]  # fmt: skip
    return saved, current


def test_megatron_alone_loses_this_runs_lr_after_an_lr_change() -> None:
    """0.19.2 finds no saved group; 0.18.2 pairs them with the checkpoint's LR in them."""
    saved, current = _saved_and_current(1e-3, 2e-3)
    if groups_keyed_by_lr():
        with pytest.raises(ValueError, match="Could not find parameter group"):
            _megatrons()(current, saved)
    else:
        groups = _megatrons()(current, [dict(g) for g in saved])
        assert [g["params"] for g in groups] == [[0, 1], [2], [3, 4, 5]]
        assert {g["max_lr"] for g in groups} == {1e-3}  # the checkpoint's, not this run's


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_groups_pair_by_their_other_keys_and_take_the_schedules_lr(use_checkpoint) -> None:
    """This run's LR (--override-opt_param-scheduler, or no scheduler flag), or with
    --use-checkpoint-opt_param-scheduler the checkpoint's, as the scheduler then reads it."""
    saved, current = _saved_and_current(1e-3, 2e-3)
    pair = matching_groups_across_lr(_megatrons())
    run = argparse.Namespace(use_checkpoint_opt_param_scheduler=use_checkpoint)
    with megatron_args(run):
        groups = pair(current, [dict(g) for g in saved])
    assert [g["params"] for g in groups] == [[0, 1], [2], [3, 4, 5]]  # Megatron's state order
    assert [(g["wd_mult"], g["is_expert_parallel"]) for g in groups] == [
        (1.0, False), (0.0, False), (1.0, True)]  # fmt: skip
    assert {g["max_lr"] for g in groups} == {1e-3 if use_checkpoint else 2e-3}


def test_an_unchanged_lr_is_megatrons_own_pairing() -> None:
    saved, current = _saved_and_current(1e-3, 1e-3)
    expected = _megatrons()(current, [dict(g) for g in saved])
    assert matching_groups_across_lr(_megatrons())(current, [dict(g) for g in saved]) == expected


@pytest.mark.skipif(
    "not groups_keyed_by_lr()",
    reason="megatron-core 0.18.2 (no MuP) keys the "
    "groups without their LR: it has no such error to keep",
)
def test_groups_that_differ_by_their_lr_alone_keep_megatrons_error() -> None:
    """As MuP's may: paired by the other keys, two groups would be one."""
    saved = [_group([0], 1e-3), _group([1], 5e-4)]
    current = [_group(["a"], 2e-3), _group(["b"], 1e-3)]
    with pytest.raises(ValueError, match="Could not find parameter group"):
        matching_groups_across_lr(_megatrons())(current, saved)


def test_the_row_replaces_megatrons_static_method() -> None:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    found = row(NAME)
    assert found.group == "launch"
    assert isinstance(MegatronOptimizer.__dict__[found.attribute.split(".")[1]], staticmethod)


_SAVED = argparse.Namespace(lr=1e-3, min_lr=0.0, decoupled_lr=None, decoupled_min_lr=None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_distributed_optimizer": True}, "distributed optimizer: the installed version's"),
        ({"use_mup": True}, "(under --use-mup the param groups may differ by their LR alone"),
        ({"decoupled_lr": 5e-4}, "(--decoupled-lr adds or removes param groups"),
    ],
    ids=["distributed-optimizer", "mup", "decoupled-lr-added"],
)  # fmt: skip
def test_an_lr_change_the_pairing_cannot_follow_is_refused(changes, message) -> None:
    args = argparse.Namespace(**{**vars(_SAVED), "lr": 2e-3, **changes})
    if message.startswith("distributed optimizer"):
        message = (
            "(Megatron 0.19.2's distributed optimizer matches the saved param groups by their LR"
            if groups_keyed_by_lr()
            else "(Megatron 0.18.2's distributed optimizer keeps the checkpoint's LR in the param"
        )
    with pytest.raises(ValueError) as refused:
        check_lr_change(args, _SAVED, "--load ckpt (iteration 2)", loads_optimizer=True)
    assert message in str(refused.value)
    assert "launch with the checkpoint's --lr 0.001 --min-lr 0.0, or pass --no-load-optim" in str(
        refused.value
    )


def test_an_lr_change_the_pairing_follows_or_no_optimizer_load_is_not_refused() -> None:
    args = argparse.Namespace(**{**vars(_SAVED), "lr": 2e-3})
    check_lr_change(args, _SAVED, "--load ckpt (iteration 2)", loads_optimizer=True)
    dist = argparse.Namespace(**{**vars(args), "use_distributed_optimizer": True})
    check_lr_change(dist, _SAVED, "--load ckpt (iteration 2)", loads_optimizer=False)
    # Keeping the checkpoint's LR: 0.18.2's distributed optimizer loads it as is; 0.19.2's finds
    # no group.
    kept = argparse.Namespace(**{**vars(dist), "use_checkpoint_opt_param_scheduler": True})
    if groups_keyed_by_lr():
        with pytest.raises(ValueError, match="Could not find parameter group"):
            check_lr_change(kept, _SAVED, "--load ckpt (iteration 2)", loads_optimizer=True)
    else:
        check_lr_change(kept, _SAVED, "--load ckpt (iteration 2)", loads_optimizer=True)
