"""torchrun that exits with the failed rank's status and leaves its refusal the last thing printed.

``python -m torch.distributed.run`` (torchrun) turns any failed worker into a ``ChildFailedError``:
about 40 lines of traceback and failure report after the worker's own message, and exit status 1,
so a launch that refused its arguments (a worker's exit 2) reads as a crash. This runs torchrun's
own ``run`` with the same arguments and, when a worker fails, exits with the status of the first
worker that failed (2 for a refusal) after one line naming it; a worker killed by a signal exits
1, as torchrun does. Everything else (rendezvous, per-rank environment, monitoring) is torchrun's.

    python -m megatron_ext.launcher --nproc-per-node 2 -m megatron_ext.pretrain_gpt --cpu ...
"""

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs torchrun with ``argv``; returns 0, or the first failed worker's exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        status = failure.exitcode if failure.exitcode > 0 else 1
        how = f"exit status {failure.exitcode}" if failure.exitcode > 0 else failure.signal_name()
        print(f"launcher: {err.name} failed on rank {rank} ({how})", file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
