"""torchrun that exits with the failed rank's status and leaves its refusal the last thing printed.

torchrun turns any failed worker into ~40 lines of traceback and exit status 1, so a launch that
refused its arguments (a worker's exit 2) reads as a crash; this is torchrun's own ``run`` with one
line naming the failed rank instead (docs/rehearse.md)::

    python -m megatron_ext.launcher --nproc-per-node 2 -m megatron_ext.pretrain_gpt --cpu ...
"""

import logging
import os
import signal
import sys
from types import FrameType

#: torchrun's routine log lines while it stops the ranks after a signal (one per rank): the
#: launcher's own line says it once. Its warning of a rank that had to be SIGKILLed is kept.
_SHUTDOWN_MESSAGES = {
    "torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
    "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s",
}


class _DropShutdownLines(logging.Filter):
    """Drops one of :data:`_SHUTDOWN_MESSAGES` from its logger."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


def main(argv: list[str] | None = None) -> int:
    """Runs torchrun with ``argv``; returns 0, the first failed worker's exit status, or 128 + the
    number of the signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) that stopped the launch."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name, message in _SHUTDOWN_MESSAGES.items():
        logging.getLogger(name).addFilter(_DropShutdownLines(message))
    received: list[signal.Signals] = []

    def interrupted(signum: int, frame: FrameType | None) -> None:
        # What torchrun's handler does, but the agent then stops the ranks by SIGTERM: SIGINT
        # would make each Python rank print a KeyboardInterrupt traceback.
        received.append(signal.Signals(signum))
        raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGTERM)

    # torchrun installs its handler for --signals-to-handle when it starts the ranks (by default
    # SIGTERM, SIGINT, SIGHUP, SIGQUIT); SIGINT becomes ours (torchrun needs one name at least).
    handled = [name.strip() for name in args.signals_to_handle.split(",")]
    if "SIGINT" in handled and len(handled) > 1:
        args.signals_to_handle = ",".join(name for name in handled if name != "SIGINT")
        signal.signal(signal.SIGINT, interrupted)
    try:
        run(args)
    except ChildFailedError as err:
        # The first worker that failed; one killed by a signal exits 1, as torchrun does.
        rank, failure = err.get_first_failure()
        status = failure.exitcode if failure.exitcode > 0 else 1
        how = f"exit status {failure.exitcode}" if failure.exitcode > 0 else failure.signal_name()
        print(f"launcher: {err.name} failed on rank {rank} ({how})", file=sys.stderr, flush=True)
        return status
    except SignalException as err:
        # torchrun's agent has signalled each rank's process group and SIGKILLed what was left
        # after its shutdown timeout. A kill -9 of the launcher never gets here: pretrain_gpt
        # ranks die with it by their parent-death signal (common.process_exit.die_with_the_agent).
        sig = received[0] if received else signal.Signals(err.sigval)
        print(
            f"launcher: {args.training_script} stopped by {sig.name}: every rank was stopped",
            file=sys.stderr,
            flush=True,
        )
        return 128 + sig
    return 0


if __name__ == "__main__":
    sys.exit(main())
