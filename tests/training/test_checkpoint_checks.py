"""Tier: one process, Megatron's functions on directories (no model, no process group).

Where ``--load`` / ``--pretrained-checkpoint`` hold no checkpoint, what the launch does: refuse in one
line, or (``--load`` also ``--save``) start from iteration 0 saying so; and the exit status of a bare
``sys.exit()`` inside Megatron's ``load_checkpoint``. Against Megatron's own checkpoints (``torch``,
``torch_dist``, saved by the real loop) and through the entry: test_startup_refusals.py.
"""

import argparse

import pytest

from megatron_ext.training.checkpoint_checks import (
    TRACKER,
    exit_nonzero_on_failed_load,
    find_load_checkpoint,
)


def _args(**kw) -> argparse.Namespace:
    defaults = dict(
        load=None, save=None, pretrained_checkpoint=None, ckpt_step=None,
        exit_on_missing_checkpoint=False, non_persistent_ckpt_type=None,
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **kw})


def test_megatrons_tracker_name_is_the_one_checked() -> None:
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    assert get_checkpoint_tracker_filename("/c") == f"/c/{TRACKER}"


def test_no_load_flag_loads_nothing_and_says_nothing() -> None:
    found = find_load_checkpoint(_args())
    assert found.checkpoint is None and found.note is None


def test_a_load_directory_without_a_checkpoint_is_refused_naming_it(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"^--load {empty} holds no checkpoint \\(no {TRACKER}\\)"):
        find_load_checkpoint(_args(load=str(empty), save=str(tmp_path / "other")))
    with pytest.raises(ValueError, match="the directory does not exist"):
        find_load_checkpoint(_args(load=str(tmp_path / "typo")))


def test_load_that_is_also_save_starts_from_iteration_0_in_one_line(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # the same directory by another name
    found = find_load_checkpoint(_args(load=str(tmp_path / "link"), save=str(tmp_path / "real")))
    assert found.checkpoint is None
    assert found.note.endswith("it is also --save): training starts from iteration 0")
    assert "\n" not in found.note


def test_exit_on_missing_checkpoint_refuses_even_an_auto_resume_directory(tmp_path) -> None:
    args = _args(load=str(tmp_path), save=str(tmp_path), exit_on_missing_checkpoint=True)
    with pytest.raises(ValueError, match="^--exit-on-missing-checkpoint: --load .* no checkpoint"):
        find_load_checkpoint(args)


def test_pretrained_checkpoint_without_one_is_refused(tmp_path) -> None:
    args = _args(load=str(tmp_path), save=str(tmp_path), pretrained_checkpoint=str(tmp_path / "b"))
    with pytest.raises(ValueError, match=f"^--pretrained-checkpoint {tmp_path / 'b'} holds no"):
        find_load_checkpoint(args)


@pytest.mark.parametrize("text", ["", "latest", "-1", "2.5"])
def test_a_tracker_megatron_cannot_read_is_refused_naming_the_file(text, tmp_path) -> None:
    (tmp_path / TRACKER).write_text(text)
    with pytest.raises(ValueError, match=f"{TRACKER} holds .*not an iteration number"):
        find_load_checkpoint(_args(load=str(tmp_path)))


def test_a_bare_sys_exit_in_load_checkpoint_exits_1(monkeypatch) -> None:
    """Megatron's ``load_checkpoint`` ends several failures with ``sys.exit()`` (status 0); the
    name the training loop calls exits 1 instead, and passes anything else through."""
    import sys

    from megatron.training import training

    outcome = {}

    def load_checkpoint(*args, **kwargs):  # stands in for Megatron's body: its exit paths
        if outcome["exit"] == "bare":
            sys.exit()
        if outcome["exit"] == "code":
            sys.exit(3)
        return 7, 0

    monkeypatch.setattr(training, "load_checkpoint", load_checkpoint)
    exit_nonzero_on_failed_load()
    exit_nonzero_on_failed_load()  # idempotent: wrapped once
    assert training.load_checkpoint.__wrapped__ is load_checkpoint
    outcome["exit"] = None
    assert training.load_checkpoint() == (7, 0)
    outcome["exit"] = "code"
    with pytest.raises(SystemExit) as stop:
        training.load_checkpoint()
    assert stop.value.code == 3
    outcome["exit"] = "bare"
    with pytest.raises(SystemExit) as stop:
        training.load_checkpoint()
    assert isinstance(stop.value.code, str)  # Python prints it and exits with status 1
    assert stop.value.code.startswith("megatron_ext: Megatron stopped while loading")


def test_an_unwritable_save_directory_is_refused_at_startup(tmp_path) -> None:
    """Megatron creates --save at the first save: an unwritable one trained until then and
    failed there with an OSError traceback on every rank."""
    from megatron_ext.training.checkpoint_checks import check_save_directory
    from tests.filesystems import read_only_dir

    check_save_directory(_args())  # no --save: nothing to check
    check_save_directory(_args(save=str(tmp_path / "new" / "deeper")))  # creatable
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"^--save {tmp_path}/file/c: {tmp_path}/file is a file"):
        check_save_directory(_args(save=str(tmp_path / "file" / "c")))
    with read_only_dir(tmp_path / "ro") as ro:
        with pytest.raises(ValueError) as err:
            check_save_directory(_args(save=str(ro / "run")))
        assert str(err.value) == (
            f"--save {ro}/run: directory {ro} (where {ro}/run would be created) is not writable: "
            "Megatron would train until the first save and fail there; name a writable directory"
        )
        with pytest.raises(ValueError, match=f"^--save {ro}: directory {ro} is not writable"):
            check_save_directory(_args(save=str(ro)))
