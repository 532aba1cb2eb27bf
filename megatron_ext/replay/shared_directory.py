"""Startup check that the ranks recording routes see one filesystem at ``--route-record-path``.

Each data-parallel rank streams its routes beside the output and rank 0 assembles them at the
end: without the check, a directory the ranks do not share is found out only when the run is
over and a stream is missing::

    rank 0 writes .rec.shared-3f2a.rank0, rank 1 .rec.shared-3f2a.rank1 (each in its own /tmp)
    -> every rank: ValueError: --route-record-path /tmp/rec: the 2 recording ranks do not share ...
"""

import os
import secrets
import time

import torch

from megatron_ext.common.safe_files import atomic_write_bytes

#: Seconds a rank waits for the others' markers unless the caller says (a network filesystem may
#: publish another client's file late). Read at each call, so a test can shorten the wait of a
#: check it reaches through the launch's own entry (``run_state.check_record_directory``).
MARKER_TIMEOUT_S = 10.0


def marker_path(directory: str, prefix: str, token: str, rank: int) -> str:
    """The marker of ``rank`` for the check named ``token``."""
    return os.path.join(directory, f".{prefix}.shared-{token}.rank{rank}")


def check_shared_directory(
    directory: str,
    rank: int,
    world_size: int,
    *,
    group: torch.distributed.ProcessGroup | None = None,
    prefix: str = "route_record",
    flag: str = "--route-record-path",
    path: str | None = None,
    timeout_s: float | None = None,
) -> None:
    """Checks that the ``world_size`` ranks of ``group`` see the same ``directory`` (collective).

    ``rank`` and ``world_size`` are in ``group`` (None: the world); ``prefix`` names the
    markers; ``flag`` and ``path`` (default ``directory``) the setting in the ValueError every
    rank raises when some rank does not see another's marker within ``timeout_s``.
    """
    # Every rank writes a marker (temporary name, renamed), a barrier, every rank looks for all
    # the others', the verdict is all-reduced (every rank raises: none is left in a collective),
    # and each removes its own.
    device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
    token_1 = torch.tensor([secrets.randbits(62) if rank == 0 else 0], device=device)
    src = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast(token_1, src, group=group)
    token = f"{int(token_1.item()):x}"  # one name per check: stale markers never count
    mine = marker_path(directory, prefix, token, rank)
    atomic_write_bytes(mine, f"{rank}\n".encode())
    try:
        torch.distributed.barrier(group=group)
        others = [r for r in range(world_size) if r != rank]
        deadline = time.monotonic() + (MARKER_TIMEOUT_S if timeout_s is None else timeout_s)
        while True:
            # os.path.exists on a fresh name asks the server (a listing could be cached).
            unseen = [
                r for r in others if not os.path.exists(marker_path(directory, prefix, token, r))
            ]
            if not unseen or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        unseen_RR = torch.zeros(world_size, world_size, dtype=torch.int64, device=device)
        unseen_RR[rank, unseen] = 1
        torch.distributed.all_reduce(unseen_RR, group=group)  # also: every rank has looked
    finally:
        os.unlink(mine)
    blind = {r: row.nonzero().flatten().tolist() for r, row in enumerate(unseen_RR.cpu())}
    blind = {r: u for r, u in blind.items() if u}
    if blind:
        what = "; ".join(f"rank {r} does not see the files of ranks {u}" for r, u in blind.items())
        raise ValueError(
            f"{flag} {path or directory}: the {world_size} recording ranks do not share the "
            f"filesystem of {directory} ({what}): every data-parallel rank streams its routes "
            "there and rank 0 assembles them; put the path on a filesystem all ranks share"
        )
