"""The ``megatron-ext`` command (:mod:`.command`; :func:`main` is the console script's entry) and
the tools' plumbing: the tools as subcommands (:mod:`.tool_commands`), their quiet imports
(:mod:`.quiet_tools`), the flag reference (:mod:`.flag_reference`)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``megatron-ext`` console script (``megatron_ext.cli:main``)."""
    from megatron_ext.cli.command import main as command

    return command(argv)
