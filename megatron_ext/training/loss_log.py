"""Each logged ``lm loss`` is its own log interval's loss: the reset Megatron 0.19.2 skips.

Megatron's ``training_log`` never zeroes its loss sums after the first line of a process; under
``--log-interval 1`` that line *is* its interval, so the second line printed the mean of two::

    --log-interval 1, losses 5.50 5.30 5.20    Megatron 0.19.2 logs  5.50 5.40 5.20
                                                 with install()        5.50 5.30 5.20

Example::

    from megatron_ext.training.loss_log import install
    install()            # before megatron.training.pretrain; idempotent
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

_MODULE = "megatron.training.training"
#: The parameters of ``training_log`` the fix reads or sets.
_PARAMETERS = ("iteration", "is_first_iteration")


def first_line_is_regular(iteration: int, log_interval: int) -> bool:
    """Whether the first logged iteration of a process is on the regular log schedule (then its
    line closes an interval and must reset the sums like any other)."""
    # Off the schedule (--log-interval 10: iteration 1, or 51 after resuming at 50) Megatron is
    # right: it prints the line and keeps the iteration in its interval, whose line then averages
    # 1..10 (51..60). The rule of the upstream fix, NVIDIA/Megatron-LM#7092 ("reset log
    # accumulators when the first iteration is on a boundary").
    return iteration % log_interval == 0


def install() -> None:
    """Makes Megatron reset its loss sums after a first logged iteration that is on the schedule.

    Idempotent. Works on any device (it changes one argument of the logging call).

    Raises:
        RuntimeError: ``training_log`` is gone from ``megatron.training.training`` or no longer
            takes ``iteration`` and ``is_first_iteration`` (a Megatron upgrade: check whether it
            fixed the reset itself, then update or drop this module).
    """
    from megatron_ext import compat

    # The loop looks training_log up in its module at each call, so replacing the module
    # attribute is enough; nothing of Megatron's body is copied.
    compat.apply_rows([compat.row(f"{_MODULE}.training_log")])


def resetting_after_regular_first_line(original: Callable[..., Any]) -> Callable[..., Any]:
    """``training_log`` that logs a first iteration on the schedule as a regular line."""
    signature = inspect.signature(original)
    missing = [name for name in _PARAMETERS if name not in signature.parameters]
    if missing:
        raise RuntimeError(
            f"megatron_ext.training.loss_log: {_MODULE}.training_log no longer takes {missing}; "
            "this megatron-core version needs the loss-log fix revisited"
        )
    return _wrap(original, signature)


def _wrap(original: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        # Megatron always prints a process's first iteration and, so that the extra line does not
        # cut the first regular interval short, keeps the sums there (should_reset = not
        # is_first_iteration). A first line on the schedule is regular: reset after it (sums,
        # counts, interval timer), its time to TensorBoard, as every later line.
        if bound.arguments.get("is_first_iteration", False):
            from megatron.training import get_args

            if first_line_is_regular(bound.arguments["iteration"], get_args().log_interval):
                bound.arguments["is_first_iteration"] = False
        return original(*bound.args, **bound.kwargs)

    return training_log
