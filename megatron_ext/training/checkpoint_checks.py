"""Startup checks of ``--load`` / ``--pretrained-checkpoint``, and a non-zero exit for a failed load.

Megatron 0.19.2 finds the checkpoint to load only once the model is built, and several of its outcomes
look like success: a ``--load`` directory without ``latest_checkpointed_iteration.txt`` (a typo, say)
trains from random weights with one warning among ~950 lines; a corrupt tracker file,
``--exit-on-missing-checkpoint`` and a checkpoint file ``torch.load`` cannot read all stop with a bare
``sys.exit()``, i.e. exit status 0 (``megatron/training/checkpointing.py``: ``read_metadata``,
``_load_base_checkpoint``, ``load_checkpoint``). :func:`find_load_checkpoint` runs before anything is
built, as Megatron looks (tracker, ``--ckpt-step``, the iteration directory and its format), and refuses
in one line what Megatron would not load; :func:`exit_nonzero_on_failed_load` turns any bare
``sys.exit()`` left inside ``load_checkpoint`` into exit status 1, with Megatron's message above it.

Example::

    found = find_load_checkpoint(args)   # ValueError: "--load /ckpt holds no checkpoint (...)"
    found.checkpoint                    # Checkpoint(directory='/ckpt', iteration=2000, ...) or None
    found.note                          # "... training starts from iteration 0" (auto-resume) or None
"""

import argparse
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Megatron's tracker file (``checkpointing.get_checkpoint_tracker_filename``).
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint Megatron would load: where it is and which flag named it."""

    flag: str  #: ``--load`` or ``--pretrained-checkpoint``
    directory: str
    iteration: int
    release: bool
    path: str  #: the ``iter_NNNNNNN`` (or ``release``) directory
    format: str  #: ``torch``, ``torch_dist``, ``torch_dcp`` or ``fsdp_dtensor``


@dataclass(frozen=True)
class LoadCheck:
    """What the launch will load: the checkpoint (None: starts from iteration 0) and a line to print."""

    checkpoint: Checkpoint | None
    note: str | None = None


def _tracker_iteration(directory: str, flag: str) -> tuple[int, bool] | None:
    """The tracker's iteration and release flag as Megatron's ``read_metadata`` reads them; None
    without a tracker file. Raises ``ValueError`` where Megatron would stop (with exit status 0)."""
    tracker = os.path.join(directory, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise ValueError(
            f"{flag} {directory}: {tracker} holds {text[:40]!r}, not an iteration number or "
            "'release' (Megatron would stop there): write the iteration of a saved iter_NNNNNNN "
            "directory into it, or name one with --ckpt-step"
        )
    return iteration, False


def find_checkpoint(
    directory: str, flag: str, ckpt_step: int | None, args: argparse.Namespace
) -> Checkpoint | None:
    """The checkpoint Megatron would load from ``directory`` (None when it would load none).

    Raises:
        ValueError: Naming ``flag`` and the file: a corrupt tracker, or an iteration directory that
            is missing or holds no checkpoint format Megatron knows.
    """
    from megatron.training import checkpointing

    found = _tracker_iteration(directory, flag)
    if found is None and not ckpt_step:
        return None
    iteration, release = found or (-1, False)
    if ckpt_step:  # Megatron's --ckpt-step wins over the tracker, as in _load_base_checkpoint
        iteration, release = ckpt_step, False
    path = checkpointing.get_checkpoint_name(directory, iteration, release, return_base_dir=True)
    if not os.path.isdir(path):
        named = f"--ckpt-step {ckpt_step}" if ckpt_step else os.path.join(directory, TRACKER)
        raise ValueError(
            f"{flag} {directory}: {named} names iteration {iteration}, but {path} does not "
            "exist (Megatron would stop there)"
        )
    try:
        ckpt_format = checkpointing._get_checkpoint_format(path, args)
    except NotImplementedError as err:
        raise ValueError(f"{flag} {directory}: {err} (no Megatron checkpoint files)") from None
    return Checkpoint(flag, directory, iteration, release, path, ckpt_format)


def find_load_checkpoint(args: argparse.Namespace) -> LoadCheck:
    """What ``load_checkpoint`` will load, decided as Megatron decides it, before anything is built.

    ``--load`` holding no checkpoint is refused unless it is also ``--save`` (a job that resumes
    itself after a restart: the note says it starts from iteration 0) or ``--pretrained-checkpoint``
    holds one (Megatron then fine-tunes from that). Non-persistent checkpoints
    (``--non-persistent-ckpt-type``) may live elsewhere and are left to Megatron.

    Raises:
        ValueError: In one line naming the flag and the directory.
    """
    from megatron_ext.config.megatron_view import MegatronView

    view = MegatronView.from_args(args)
    load, pretrained, step = view.load, view.pretrained_checkpoint, view.ckpt_step
    if pretrained and not (load and os.path.isfile(os.path.join(load, TRACKER))):
        # load_checkpoint: "Checkpoint file not found in load directory ... attempting to
        # finetune with checkpoint in" --pretrained-checkpoint
        found = find_checkpoint(pretrained, "--pretrained-checkpoint", step, args)
        if found is None:
            also = f"; nor does --load {load}" if load else ""
            raise ValueError(
                f"--pretrained-checkpoint {pretrained} holds no checkpoint (no {TRACKER}{also}): "
                "Megatron would stop with 'No checkpoint found'; name a directory Megatron saved"
            )
        return LoadCheck(found)
    found = find_checkpoint(load, "--load", step, args) if load else None
    if found is not None:
        return LoadCheck(found)
    if not load or view.non_persistent_ckpt_type:
        return LoadCheck(None)
    where = "the directory does not exist" if not os.path.isdir(load) else f"no {TRACKER}"
    if view.exit_on_missing_checkpoint:
        raise ValueError(
            f"--exit-on-missing-checkpoint: --load {load} holds no checkpoint ({where})"
        )
    save = view.save
    if save and os.path.realpath(save) == os.path.realpath(load):
        return LoadCheck(
            None,
            f"--load {load} holds no checkpoint yet ({where}; it is also --save): "
            "training starts from iteration 0",
        )
    raise ValueError(
        f"--load {load} holds no checkpoint ({where}): Megatron would train from random weights. "
        "Fix the path; to start fresh and resume from one directory later, pass it as --save too"
    )


def exit_nonzero_on_failed_load() -> None:
    """Makes the training loop's ``load_checkpoint`` exit with status 1 where Megatron's bare
    ``sys.exit()`` inside it would exit 0 (a checkpoint file it cannot read, a missing RNG state,
    ...), after Megatron's own message. Idempotent; wraps the name ``megatron.training.training``
    calls, failing loudly if it has moved."""
    from megatron_ext import compat

    compat.apply_rows([compat.row("megatron.training.training.load_checkpoint")])


def exiting_nonzero(original: Callable[..., Any]) -> Callable[..., Any]:
    """``load_checkpoint`` whose bare ``sys.exit()`` exits with status 1 (see above)."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
            raise SystemExit(
                "megatron_ext: Megatron stopped while loading the checkpoint (its message is "
                "above), before training: exit status 1"
            ) from None

    return load_checkpoint
