"""Tier: pure. Which commands tests/dry_run_server.py forks: only a plain dry run of the entry, by
the server's interpreter, under the environment the server imported under (its end-to-end checks
are tests/training/test_example_dry_runs.py's and test_doc_commands.py's)."""

from tests.dry_run_client import why_not_forked

SERVER = {
    "python": "/venv/bin/python",
    "start_env": {"PATH": "/bin", "HF_HUB_OFFLINE": "1"},  # what the server started under
    "env": {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/i"},  # after
    "run_time": ["DATA", "WORLD_SIZE"],
}
DRY_RUN = ["-m", "megatron_ext.pretrain_gpt", "--num-layers", "2", "--dry-run"]


def why(argv=DRY_RUN, env=None, python="/venv/bin/python"):
    return why_not_forked(argv, SERVER["start_env"] if env is None else env, python, SERVER)


def test_a_plain_dry_run_under_the_servers_environment_is_forked():
    assert why() is None
    assert why(env=SERVER["env"]) is None  # the environment its imports left
    # The scripts' variables, bash's own, and a non-interactive shell's dropped prompt.
    assert why(env={"PATH": "/bin", "HF_HUB_OFFLINE": "1", "DATA": "/d", "WORLD_SIZE": "8",
                    "PWD": "/w", "SHLVL": "2", "_": "/venv/bin/python"}) is None  # fmt: skip


def test_what_a_fork_would_not_reproduce_runs_as_written():
    assert why(["-c", "pass"]) == "not -m megatron_ext.pretrain_gpt"
    assert why(DRY_RUN[:-1]) == "not a dry run"
    for flag in ("--cpu", "--verbose", "--logging-level=INFO"):
        assert why([*DRY_RUN, flag]).endswith("the entry does more before Megatron's import")
    assert why(python="/usr/bin/python3").startswith("interpreter /usr/bin/python3")
    assert why(env={"PATH": "/bin"}) == "import-time variables differ: HF_HUB_OFFLINE"
    assert why(env={**SERVER["start_env"], "OMP_NUM_THREADS": "4"}) == (
        "import-time variables differ: OMP_NUM_THREADS"
    )
