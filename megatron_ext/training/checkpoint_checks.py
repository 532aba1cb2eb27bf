"""Startup checks of ``--load`` / ``--pretrained-checkpoint`` and ``--save``, and a non-zero exit for a
failed load: what Megatron 0.19.2 would stop on late (or with exit status 0) is refused before
anything is built, in one line (docs/limits.md, "Checkpoint and resume"). Example::

    found = find_load_checkpoint(args)   # ValueError: "--load /ckpt holds no checkpoint (...)"
    found.checkpoint                    # Checkpoint(directory='/ckpt', iteration=2000, ...) or None
    found.note                          # "... training starts from iteration 0" (auto-resume) or None
"""

import argparse
import errno
import functools
import glob
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ext.config.megatron_view import MegatronView

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
    without a tracker file.

    Raises:
        ValueError: Where Megatron would stop (with a bare ``sys.exit()``: exit status 0).
    """
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
    """What ``load_checkpoint`` will load, decided as Megatron decides it (tracker, ``--ckpt-step``,
    the iteration directory and its format), before anything is built.

    Raises:
        ValueError: In one line naming the flag and the directory.
    """
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
    # Non-persistent checkpoints may live elsewhere: left to Megatron.
    if not load or view.non_persistent_ckpt_type:
        return LoadCheck(None)
    where = "the directory does not exist" if not os.path.isdir(load) else f"no {TRACKER}"
    if view.exit_on_missing_checkpoint:
        raise ValueError(
            f"--exit-on-missing-checkpoint: --load {load} holds no checkpoint ({where})"
        )
    # Megatron would train from random weights with one warning among ~950 lines (a typo, say);
    # but a --load that is also --save is a job that resumes itself after a restart.
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
    ``sys.exit()`` inside it would exit 0, after Megatron's own message. Idempotent."""
    # The bare sys.exit()s: a checkpoint file torch.load cannot read, a missing RNG state, ...
    # (megatron/training/checkpointing.py: read_metadata, _load_base_checkpoint, load_checkpoint).
    # The row wraps the name megatron.training.training calls, failing loudly if it has moved.
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


def check_save_directory(args: argparse.Namespace) -> None:
    """Refuses a ``--save`` Megatron could not write: the directory, or where it would be created
    (its first existing ancestor), must be a writable directory."""
    # Megatron creates it at the first save, so an unwritable one trains until then and fails
    # there on every rank (OSError).
    save = MegatronView.from_args(args).save
    if not save:
        return
    probe = os.path.abspath(save)
    while not os.path.exists(probe):  # the first existing ancestor decides
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"--save {save}: {probe} is a file, not a directory")
    # os.access asks the kernel, so a read-only mount is refused for root too.
    if not os.access(probe, os.W_OK | os.X_OK):
        made = "" if probe == os.path.abspath(save) else f" (where {save} would be created)"
        raise ValueError(
            f"--save {save}: directory {probe}{made} is not writable: Megatron would train until "
            "the first save and fail there; name a writable directory"
        )


def check_checkpoint_files(checkpoint: Checkpoint) -> None:
    """Refuses a checkpoint whose files Megatron would fail to read, naming the file: without
    reading a tensor, from the sizes its index promises.

    Raises:
        ValueError: In one line naming the file and what is wrong with it.
    """
    where = f"{checkpoint.flag} {checkpoint.directory} (iteration {checkpoint.iteration})"
    if checkpoint.format == "torch_dist":
        _check_distcp_files(checkpoint.path, where)
    elif checkpoint.format == "torch":
        import zipfile

        # torch.save writes a zip archive: one cut short or overwritten does not open as one.
        for path in sorted(glob.glob(os.path.join(checkpoint.path, "mp_rank_*", "*.pt"))):
            try:
                with zipfile.ZipFile(path):
                    pass
            except (OSError, zipfile.BadZipFile) as err:
                raise ValueError(
                    f"{where}: {path} cannot be read ({error_cause(err)}; a torch.save file cut short "
                    "or overwritten?)"
                ) from None


def _check_distcp_files(path: str, where: str) -> None:
    """``torch_dist``: the ``.metadata`` index and every ``.distcp`` file it indexes, present and as
    long as its last item."""
    # Megatron reads a missing index as ``metadata is None``, and a truncated .distcp as
    # "EOFError: Ran out of input", naming no file.
    from torch.distributed.checkpoint import FileSystemReader

    index = os.path.join(path, ".metadata")
    if not os.path.isfile(index):
        raise ValueError(
            f"{where}: {index} is missing (the index of every tensor in {path}; a copy that left "
            "out hidden files, or a save that never finished): Megatron cannot load it"
        )
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 -- an unpickling failure may be any exception
        raise ValueError(f"{where}: {index} cannot be read ({error_cause(err)})") from None
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        end = item.offset + item.length
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        try:
            found = os.path.getsize(file)
        except OSError as err:
            raise ValueError(
                f"{where}: {file} cannot be read ({error_cause(err)}); {index} indexes "
                f"{size} bytes of it"
            ) from None
        if found < size:
            raise ValueError(
                f"{where}: {file} is truncated ({found} bytes; {index} indexes {size}): "
                "Megatron would stop with 'EOFError: Ran out of input'"
            )


def error_cause(err: BaseException, errno_name: bool = False) -> str:
    """An exception as ``Type: message`` on one line; an ``OSError`` as its ``strerror`` (with
    ``errno_name``, followed by its ``(ENOSPC)``)."""
    if isinstance(err, OSError) and err.strerror:
        name = errno.errorcode.get(err.errno or 0) if errno_name else None
        return f"{err.strerror} ({name})" if name else err.strerror
    message = " ".join(str(err).split())
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def check_checkpoint_model(
    args: argparse.Namespace, checkpoint: Checkpoint, padded_vocab: int | None
) -> dict[str, Any] | None:
    """Refuses a checkpoint of another model than the run builds, naming the first difference
    (class, layers, hidden size, experts, a ``torch`` checkpoint's padded vocabulary), read from the
    arguments it was saved with, no tensor. ``padded_vocab`` None: unknown here, not compared.

    Returns:
        The checkpoint's saved state (:func:`saved_state`), for the resume check to read again.

    Raises:
        ValueError: In one line: the flag, the checkpoint's value and this run's.
    """
    try:
        state = saved_state(checkpoint)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 -- Megatron's reader raises what its storage does
        raise ValueError(
            f"{checkpoint.flag} {checkpoint.directory}: the saved arguments in {checkpoint.path} "
            f"cannot be read ({error_cause(err)})"
        ) from None
    saved = None if state is None else state.get("args")
    if saved is None:
        return state
    # Megatron would fail loading it on every rank after building the model (KeyError, shape
    # mismatches, CheckpointException).
    view = MegatronView.from_args(args)
    difference = _model_difference(view, saved, checkpoint.format, padded_vocab)
    if difference is not None:
        raise ValueError(
            f"{checkpoint.flag} {checkpoint.directory} (iteration {checkpoint.iteration}) holds "
            f"another model: {difference}; Megatron would fail loading it after building the "
            "model. Name a checkpoint of this model, or match its flags"
        )
    return state


def _pattern(layer_pattern: str | None, override_pattern: str | None) -> str | None:
    """The hybrid layer pattern (Megatron's older name too), pipeline separators left out."""
    pattern = layer_pattern or override_pattern
    return pattern.replace("|", "") if pattern else None


def maps_gpt_layers_to_hybrid() -> bool:
    """Whether Megatron loads a GPTModel's torch_dist checkpoint into a HybridModel
    (``megatron.core.dist_checkpointing.gpt_checkpoint_interop``: 0.19.2 has it, 0.18.2 not)."""
    import importlib.util

    return (
        importlib.util.find_spec("megatron.core.dist_checkpointing.gpt_checkpoint_interop")
        is not None
    )


def _model_difference(
    view: MegatronView, saved: Any, ckpt_format: str, padded_vocab: int | None
) -> str | None:
    """The first difference between the saved model (``saved``: the arguments the checkpoint
    recorded, of any Megatron version) and this run's, as ``what (the checkpoint's -> this
    run's)``; None when they match."""
    before = _pattern(
        getattr(saved, "hybrid_layer_pattern", None),
        getattr(saved, "hybrid_override_pattern", None),
    )
    now = _pattern(view.hybrid_layer_pattern, view.hybrid_override_pattern)
    if before and not now:
        return f"class HybridModel --hybrid-layer-pattern '{before}' -> GPTModel"
    if now and not before:
        # What Megatron 0.19.2's _maybe_setup_gpt_to_hybrid_load accepts: torch_dist, a pattern
        # pairing one attention and one MLP position with each GPT layer, and TE layers (with
        # local modules, every --cpu run, the layer norms' keys differ: KeyError).
        gpt_layers = getattr(saved, "num_layers", None)
        if not maps_gpt_layers_to_hybrid():
            return (
                "class GPTModel -> HybridModel (megatron-core before 0.19 maps no GPT "
                "checkpoint's layers onto a HybridModel)"
            )
        if ckpt_format != "torch_dist":
            return "class GPTModel -> HybridModel (Megatron maps GPT layers only from torch_dist)"
        from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
            gpt_compatible_layer_maps,
        )

        try:
            pairs = gpt_compatible_layer_maps(now).num_gpt_layers
        except ValueError as err:
            return f"class GPTModel -> HybridModel ({error_cause(err)})"
        if gpt_layers is not None and gpt_layers != pairs:
            return (
                f"--num-layers {gpt_layers} -> --hybrid-layer-pattern '{now}' (it pairs with a "
                f"GPTModel of {pairs} layers)"
            )
        if view.transformer_impl != "transformer_engine":
            return (
                f"class GPTModel -> HybridModel with --transformer-impl {view.transformer_impl} "
                "(Megatron 0.19.2 maps a GPT checkpoint's layers onto Transformer Engine ones "
                "only: the local layer norms' keys differ)"
            )
    elif now and before != now:
        return f"--hybrid-layer-pattern '{before}' -> '{now}'"
    elif not now and getattr(saved, "num_layers", None) != view.num_layers:
        return f"--num-layers {getattr(saved, 'num_layers', None)} -> {view.num_layers}"
    for dest, flag in (("hidden_size", "--hidden-size"), ("num_experts", "--num-experts")):
        if hasattr(saved, dest) and getattr(saved, dest) != getattr(view, dest):
            return f"{flag} {getattr(saved, dest)} -> {getattr(view, dest)}"
    # torch_dist loads the embedding and output layer into another padded vocabulary (Megatron
    # saves them with allow_shape_mismatch); a torch file's load_state_dict is strict.
    saved_vocab = getattr(saved, "padded_vocab_size", None) if ckpt_format == "torch" else None
    if padded_vocab is not None and saved_vocab is not None and saved_vocab != padded_vocab:
        return f"padded vocabulary {saved_vocab} -> {padded_vocab} (--vocab-size / tokenizer)"
    return None


def saved_state(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """The checkpoint's non-sharded part (``args``, ``iteration``, ``opt_param_scheduler``) without
    its tensors: ``torch_dist``'s common state dict, or a ``torch`` rank file memory-mapped. None for
    the other formats (not checked)."""
    import torch

    if checkpoint.format == "torch_dist":
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        return load_common_state_dict(checkpoint.path)
    if checkpoint.format != "torch":
        return None
    files = sorted(glob.glob(os.path.join(checkpoint.path, "mp_rank_*", "model_optim_rng.pt")))
    if not files:
        raise ValueError(f"{checkpoint.flag} {checkpoint.directory}: no model_optim_rng.pt under "
                         f"{checkpoint.path}")  # fmt: skip
    try:
        return torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 -- Megatron's own load catches any (and exits 0)
        raise ValueError(
            f"{checkpoint.flag} {checkpoint.directory}: {files[0]} cannot be read "
            f"({type(err).__name__}: {' '.join(str(err).split())})"
        ) from None
