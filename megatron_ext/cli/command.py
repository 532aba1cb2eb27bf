"""The ``megatron-ext`` command: ``bench`` (writes docs/BENCHMARKS.md), ``demo`` (the CPU main job),
``flags`` (the flag reference) and the tools (``preprocess-data``, ``convert-routes``, ...)."""

import argparse
import os
import sys

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)


def build_parser() -> argparse.ArgumentParser:
    """Parser for ``megatron-ext``."""
    # The module docstring is the command's --help description.
    parser = argparse.ArgumentParser(prog="megatron-ext", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--verbose", action="store_true", help="show every warning")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run benchmarks side by side and write docs/BENCHMARKS.md")
    bench.add_argument("--quick", action="store_true", help="CI-sized runs (seconds per benchmark)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument(
        "--markdown", metavar="PATH", default="docs/BENCHMARKS.md", help="report path"
    )
    bench.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    bench.add_argument(
        "--overwrite", action="store_true", help="replace an existing --markdown/--json"
    )
    bench.add_argument(
        "--update",
        action="store_true",
        help="merge the --only benchmarks into the existing --json and --markdown (the other "
        "sections keep their figures; each section names the run that measured it)",
    )

    demo = sub.add_parser(
        "demo", help="the CPU main job: Megatron's real training loop, 2 gloo ranks, EP=2"
    )
    demo.add_argument("--steps", type=int, default=6, help="training iterations per run")
    demo.add_argument(
        "--workdir", metavar="DIR", help="keep data and logs here (an empty or new directory)"
    )
    demo.add_argument("--overwrite", action="store_true", help="replace an existing --json/--png")
    demo.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    demo.add_argument(
        "--png", metavar="PATH", default="out/demo_load.png", help="per-expert load plot"
    )
    # Packaging: the flag reference and the tools as subcommands.
    from megatron_ext.cli.tool_commands import add_tool_commands

    flags = sub.add_parser("flags", help="print every megatron_ext flag with its help")
    flags.add_argument(
        "--markdown", action="store_true", help="as Markdown (docs/flags.md is this output)"
    )
    add_tool_commands(sub)
    from megatron_ext.rehearse.matrix import add_parser as add_rehearse

    add_rehearse(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``megatron-ext`` console script."""
    from megatron_ext.data.tool_errors import run_tool

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_ext.cli.tool_commands import tool_command

    # A tool takes its own arguments, which this parser does not know: tools are dispatched first.
    status = tool_command(sys.argv[1:] if argv is None else argv)
    if status is not None:
        return status
    args = build_parser().parse_args(argv)

    # Subcommands import lazily so that ``megatron-ext flags`` does not import the benchmarks.
    def run(_: list[str] | None) -> int:
        if args.command == "flags":
            from megatron_ext.cli.flag_reference import main as flags_main

            return flags_main(args)
        if args.command == "bench":
            from megatron_ext.bench.report import main as bench_main

            return bench_main(args)
        if args.command == "rehearse":
            from megatron_ext.rehearse.matrix import main as rehearse_main

            return rehearse_main(args)
        from megatron_ext.rehearse.demo import main as demo_main

        return demo_main(args)

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
