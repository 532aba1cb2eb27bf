"""A checkpoint save that fails says so in one line per rank, naming the file and the cause (exit 1;
``--verbose`` keeps Megatron's traceback). Example (a full disk)::

    megatron_ext: saving the checkpoint of iteration 2 to /ckpt failed: writing
    /ckpt/iter_0000002/__0_0.distcp: No space left on device (ENOSPC); ...
"""

import errno
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_ext.training.checkpoint_checks import error_cause

#: The writes that failed in this process since the current save began: ``(file, error)``.
#: The writer's threads append; :func:`failing_in_one_line` clears it before each save.
WRITE_FAILURES: list[tuple[str, BaseException]] = []


def recording_write_errors(original: Any) -> Any:
    """``FileSystemWriterAsync.write_preloaded_data`` (a staticmethod) that also records the
    exception Megatron's writer catches, with the file it was writing."""
    # Megatron 0.19.2's torch_dist writer catches the OSError of a failed write and hands on only
    # its class: a full disk ended the run with "CheckpointException ... error: <class 'OSError'>"
    # and ~160 lines of tracebacks on every rank, never saying "No space left on device" nor which
    # file.
    function = getattr(original, "__func__", original)

    @functools.wraps(function)
    def write_preloaded_data(*args: Any, **kwargs: Any) -> Any:
        out = function(*args, **kwargs)
        bucket = kwargs["write_bucket"] if "write_bucket" in kwargs else args[2]
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], BaseException):
            WRITE_FAILURES.append((str(bucket[0]), out[1]))
        return out

    return staticmethod(write_preloaded_data)


def failing_in_one_line(original: Callable[..., Any]) -> Callable[..., Any]:
    """``save_checkpoint`` whose failure exits with status 1 and one line (:func:`failed_save_line`)."""

    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        WRITE_FAILURES.clear()
        try:
            return original(iteration, *args, **kwargs)
        # torch's CheckpointException (every torch_dist write failure) is a BaseException.
        except BaseException as err:  # noqa: BLE001 -- every failed save becomes one line
            if "--verbose" in sys.argv or isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            from megatron.training import get_args

            line = failed_save_line(iteration, get_args().save, err, list(WRITE_FAILURES))
            rank = os.environ.get("RANK")
            raise SystemExit(
                f"megatron_ext: {line}" + (f" (rank {rank})" if rank else "")
            ) from None

    return save_checkpoint


def failed_save_line(
    iteration: int, save: str, err: BaseException, failures: list[tuple[str, BaseException]]
) -> str:
    """What went wrong in a failed save, in one line: the first failed write of this process
    (file and ``strerror``), else the first ``OSError`` in the exception's chain, else the
    exception itself (another rank's write, a writer that keeps no errno)."""
    head = f"saving the checkpoint of iteration {iteration} to {save} failed: "
    tail = _last_whole(save)
    for file, cause in failures:
        return (
            head
            + f"writing {file}: {error_cause(cause, errno_name=True)}"
            + _free_space(save, cause)
            + tail
        )
    chained: BaseException | None = err
    while chained is not None:
        if isinstance(chained, OSError) and chained.strerror:
            where = f"{chained.filename}: " if chained.filename else ""
            return (
                head
                + where
                + error_cause(chained, errno_name=True)
                + _free_space(save, chained)
                + tail
            )
        chained = chained.__cause__ or chained.__context__
    message = " ".join(str(err).split())[:300]
    return head + f"{type(err).__name__}: {message}" + _free_space(save, err) + tail


def _free_space(save: str, err: BaseException) -> str:
    """`` (no space left on the filesystem of DIR)`` when it has no free block and ``err`` is not
    ENOSPC itself, else ``""``: a writer that kept no errno (``torch.save`` into a stream raises
    ``RuntimeError``) still says so when the disk is full."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return ""
    probe = os.path.abspath(save)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        stat = os.statvfs(probe)
    except OSError:
        return ""
    full = f" (No space left on device: the filesystem of {probe} has no free block)"
    return full if stat.f_bavail == 0 else ""


def _last_whole(save: str) -> str:
    """What a restart from ``save`` loads."""
    # Megatron writes its tracker only after a whole save: a failed one leaves the last whole.
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    try:
        with open(tracker) as f:
            last = f.read().strip()
    except OSError:
        return f"; {save} holds no whole checkpoint"
    return f"; {tracker} still names the last whole one ({last})"
