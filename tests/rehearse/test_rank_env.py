"""Tier: pure. ``megatron_ext.rehearse.rank_env``: what a launcher gives each rank, against the
variables torch's own agent sets (torch.distributed.elastic's LocalElasticAgent, the torchrun
worker environment, in the installed torch), and no import circle in ``megatron_ext.testing``."""

import ast
import inspect
import re
import socket

from megatron_ext.rehearse.rank_env import free_port, rank_env


def test_every_variable_is_one_torchruns_agent_sets() -> None:
    from torch.distributed.elastic.agent.server import local_elastic_agent

    source = inspect.getsource(local_elastic_agent)  # torch 2.x: worker_env in _start_workers
    agent_sets = set(re.findall(r"worker_env\[\"([A-Z_]+)\"\]", source)) | set(
        re.findall(r"\"([A-Z_]+)\": ", source[source.index("worker_env = {") :])
    )
    env = rank_env(1, 2, "1234")
    assert set(env) <= agent_sets, set(env) - agent_sets
    assert env["RANK"] == env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_PORT"] == "1234"


def test_free_port_can_be_bound() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_the_launch_server_imports_no_launcher() -> None:
    """rank_server.py (the server) and local_launch.py (the launcher, which imports it) share only
    rank_env.py: no import of the launcher anywhere in the server's module."""
    from megatron_ext.rehearse import rank_server as preloaded

    tree = ast.parse(inspect.getsource(preloaded))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "megatron_ext.rehearse.rank_env" in imported
    assert not [name for name in imported if "local_launch" in name or "real_loop" in name]
