"""What a launcher gives each rank of one node: torchrun's per-worker variables and a free rendezvous
port. Shared by :mod:`megatron_ext.rehearse.local_launch` (which launches) and
:mod:`megatron_ext.rehearse.rank_server` (which must tell these run-time variables from the ones read at
import)."""

import socket


def free_port() -> int:
    """A TCP port nothing listens on right now (for torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, port: str) -> dict[str, str]:
    """The variables torchrun's agent sets for worker ``rank`` of one node."""
    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")
    return {
        **{name: str(rank) for name in names},
        **{name: str(world_size) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")},
        "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
    }  # fmt: skip
