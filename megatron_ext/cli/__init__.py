"""The ``megatron-ext`` command and its subcommands (tools, flag reference, bench, demo, rehearse)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``megatron-ext`` console script (``megatron_ext.cli:main``)."""
    # Imported here, not at the top: ``import megatron_ext.cli`` stays free of the command's imports.
    from megatron_ext.cli.command import main as command

    return command(argv)
