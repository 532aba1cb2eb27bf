"""Tier: Megatron on one rank (argument parsing, Megatron's logging seams), then gloo ranks (a tiny
``--cpu`` launch's whole output, a refusal) and torchrun (``megatron_ext.launcher``'s exit status).

What a launch prints (megatron_ext.training.launch_log): the argument dump only when asked, a short
configuration, Megatron's INFO logs only when a level is chosen, and no line that is never true of the
run (memory on a machine without CUDA, the theoretical-memory line a HybridModel cannot have, the
async-save deprecation on a synchronous save); a refusal printed once with exit status 2.
"""

import contextlib
import logging
import sys

import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, free_port, launch
from megatron_ext.training import launch_log
from tests.training.entry_args import BASE_ARGS

#: A tiny launch's output, every rank's lines together (no torchrun banner: the forked ranks).
MAX_LINES = 100


def _parse(monkeypatch, *extra: str):
    from megatron_ext.pretrain_gpt import parse_arguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = ["pretrain_gpt", *BASE_ARGS, "--mock-data", "--tokenizer-type", "NullTokenizer"]
    monkeypatch.setattr(sys, "argv", [*argv, "--vocab-size", "257", *extra])
    return parse_arguments(dry_run=True)


def test_argument_dump_prints_only_with_log_arguments(monkeypatch, capsys) -> None:
    """Megatron's ``validate_args`` dumps every argument (hundreds of lines) unless asked."""
    args = _parse(monkeypatch)
    quiet = capsys.readouterr().out
    assert not args.log_arguments and "------------------------ arguments" not in quiet
    _parse(monkeypatch, "--log-arguments")
    dump = capsys.readouterr().out
    assert "------------------------ arguments" in dump
    assert sum(" .... " in line or "...." in line for line in dump.splitlines()) > 500
    from megatron.training import arguments

    assert not hasattr(arguments._print_args, "__wrapped__")  # the original is back after parsing


def test_parser_error_is_one_line_naming_the_flag(monkeypatch) -> None:
    """argparse's own error prints the usage of every flag (about 1,300 lines) first."""
    with pytest.raises(ValueError, match=r"^argument --pad-policy: invalid choice: 'bogus'"):
        _parse(monkeypatch, "--pad-policy", "bogus")


def test_configuration_lines_name_model_parallelism_data_and_flags(monkeypatch) -> None:
    from megatron_ext.pretrain_gpt import resolved_configuration

    args = _parse(monkeypatch, "--moe-expert-load-metrics", "--moe-pad-routing", "dispatch")
    lines = launch_log.configuration_lines(args, resolved_configuration(args))
    assert len(lines) == 4, lines
    model, parallel, data, flags = lines
    assert "GPTModel: 2 layers, hidden 64, 4 heads, 8 experts top-2" in model, model
    assert "2 ranks: data 2, tensor 1, pipeline 1, context 1, expert 2" in parallel, parallel
    assert "MockGPTDataset, sequence 64" in data, data
    assert flags == "megatron_ext: flags --moe-expert-load-metrics --moe-pad-routing dispatch", (
        flags
    )


@pytest.mark.parametrize(
    ("argv", "environ", "quieted"),
    [
        ([], {}, True),
        (["--logging-level", "20"], {}, False),
        (["--logging-level=20"], {}, False),
        ([], {"MEGATRON_LOGGING_LEVEL": "20"}, False),
        (["--verbose"], {}, False),
    ],
)
def test_megatron_info_logs_stay_quiet_unless_a_level_is_chosen(argv, environ, quieted) -> None:
    logger = logging.getLogger("megatron")
    level = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        assert launch_log.quiet_megatron_info(argv, environ) is quieted
        child = logging.getLogger("megatron.core.datasets.indexed_dataset")
        expected = logging.WARNING if quieted else logging.getLogger().getEffectiveLevel()
        assert child.getEffectiveLevel() == expected
        ours = logging.getLogger("megatron_ext.data.packed_dataset")  # not Megatron's: untouched
        assert ours.getEffectiveLevel() == logging.getLogger().getEffectiveLevel()
    finally:
        logger.setLevel(level)


@pytest.fixture
def launch_rows(monkeypatch):
    """The ``launch`` compatibility rows applied for the test, reading ``run`` as Megatron's
    global arguments (what ``get_args()`` returns during ``pretrain``)."""
    from megatron.training import global_vars

    from megatron_ext import compat

    def as_run(args) -> None:
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)

    with compat.patched("launch"):
        yield as_run


def test_memory_lines_that_do_not_apply_are_left_out(monkeypatch, launch_rows, capsys) -> None:
    """No CUDA: the memory report (all 0.00) is left out unless --log-memory-interval asks for it
    (read when Megatron reports, not when the row is applied); the theoretical estimate is left out
    for a HybridModel only (Megatron has none for it)."""
    import torch
    from megatron.training import training

    args = _parse(monkeypatch)
    launch_rows(args)
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.report_memory("(after 1 iterations)") is None
    assert capsys.readouterr().out == ""
    args.hybrid_layer_pattern = "*E*E"
    training.report_theoretical_memory(args, num_microbatches=1, verbose=True)
    assert capsys.readouterr().out == ""
    # Megatron's own function prints the line the row leaves out.
    training.report_theoretical_memory.__wrapped__(args, num_microbatches=1, verbose=True)
    assert "Theoretical memory footprints not yet supported" in capsys.readouterr().out

    args.log_memory_interval = 1  # asked for: Megatron's report runs
    assert _reports_memory(training, capsys)
    args.log_memory_interval, args.verbose = None, True
    assert _reports_memory(training, capsys)
    args.verbose = False
    assert not _reports_memory(training, capsys)


def _reports_memory(training, capsys) -> bool:
    """Whether Megatron's own ``report_memory`` ran: it prints the line, or, with no process group
    in this process, fails asking for one."""
    try:
        training.report_memory("(after 2 iterations)")
    except ValueError as err:
        assert "process group" in str(err)
        return True
    return "(after 2 iterations)" in capsys.readouterr().out


def test_async_save_deprecation_is_left_out_of_a_synchronous_save_only(
    monkeypatch, launch_rows, tmp_path
) -> None:
    """Megatron's synchronous ``save`` calls ``async_save(..., async_strategy="mcore")``, which logs
    the deprecation first; while the row's ``save`` runs that record is dropped, unless --async-save
    was asked for, and the logger is as before once it returns."""
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    name, prefix = launch_log.ASYNC_SAVE_DEPRECATION
    assert strategy.logger.name == name
    logger = logging.getLogger(name)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "level", logging.WARNING)
    args = _parse(monkeypatch)
    launch_rows(args)
    save = strategy.TorchDistSaveShardedStrategy("torch_dist", 1)
    shown = []
    for async_save in (True, False):
        args.async_save = async_save
        monkeypatch.setattr(strategy, "_logged_mcore_async_deprecation", False)  # once per process
        seen.clear()
        with contextlib.suppress(Exception):  # an empty state dict on no process group
            save.save({}, tmp_path)
        shown.append(any(m.startswith(prefix) for m in seen))
    assert shown == [True, False]  # asked for async save: its deprecation shows
    assert logger.filters == []  # dropped only while the synchronous save runs


def test_a_tiny_launch_prints_at_most_a_hundred_lines(corpus_prefix) -> None:
    run = launch([*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "4"]).check()
    lines = run.output.splitlines()
    assert sorted(run.losses) == [1, 2, 3, 4], run.output[-2000:]  # one line per interval
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{run.output}"
    assert sum(line.startswith("megatron_ext: model GPTModel") for line in lines) == 1
    assert sum(line.startswith("megatron_ext tokens/s") for line in lines) == 4
    for absent in ("end of arguments", "memory (MB)", "footprints not yet", "INFO:megatron."):
        assert absent not in run.output, absent


def test_a_refusal_prints_once_and_exits_2(corpus_prefix) -> None:
    run = launch(
        [*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--moe-expert-load-log", "x.jsonl"]
    )
    assert run.returncode == 2, run.output[-2000:]
    refusals = [line for line in run.output.splitlines() if "invalid arguments" in line]
    assert refusals == [
        "megatron_ext: invalid arguments: --moe-expert-load-log needs --moe-expert-load-metrics"
    ], run.output[-2000:]


@pytest.mark.parametrize("rank", ["0", "1", None])
def test_only_the_first_rank_refuses_at_once(rank, monkeypatch, capsys) -> None:
    """Every rank checks the same arguments; the others wait for the launcher to stop them (a
    refusal only they see still prints, after the wait, naming the rank)."""
    waits = []
    monkeypatch.setattr(launch_log.time, "sleep", waits.append)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert launch_log.refuse("invalid arguments: --x") == 2
    first = rank in ("0", None)
    assert waits == ([] if first else [launch_log.REFUSAL_GRACE_S])
    suffix = "" if first else f" (rank {rank})"
    assert capsys.readouterr().err == f"megatron_ext: invalid arguments: --x{suffix}\n"


def test_launcher_exits_with_the_first_failed_rank_status(tmp_path) -> None:
    """torchrun exits 1 after a ChildFailedError report; the launcher with the worker's status."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] != '0':\n    time.sleep(30)\n"
        "print('worker: refused', file=sys.stderr)\nsys.exit(2)\n"
    )
    from megatron_ext import launcher
    from megatron_ext.testing.processes import exit_status, fork_main

    argv = ["--nproc-per-node", "2", "--master-port", str(free_port()), str(script)]
    log = tmp_path / "launcher.log"
    # The launcher forked from this process (torch imported): the seconds of a fresh interpreter's
    # imports are not what is tested; its workers are fresh interpreters, as torchrun starts them.
    pid = fork_main(lambda: launcher.main(argv), log)
    assert exit_status(pid, timeout=120) == 2, log.read_text()
    stderr = log.read_text()
    assert stderr.count("worker: refused") == 1
    assert "ChildFailedError" not in stderr and "Traceback" not in stderr
    assert "launcher: " in stderr.splitlines()[-1] and "rank 0 (exit status 2)" in stderr


def test_expert_load_metrics_reach_the_tensorboard_writer(corpus_prefix, tmp_path) -> None:
    """``--tensorboard-dir``: Megatron's writer (on the last rank) gets megatron_ext's expert-load
    scalars at every log interval; read back from the event file with TensorBoard's own
    ``EventAccumulator`` (tensorboard 2.21.0, the version requirements/lock.txt pins)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install .[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    run = launch([
        *TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "2",
        "--moe-expert-load-metrics", "--tensorboard-dir", str(board),
    ]).check()  # fmt: skip
    assert "TensorBoard writing requested but is not available" not in run.output
    events = EventAccumulator(str(board))
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t.startswith("expert_load/")]
    assert any(t.endswith("rank_max_vio") for t in tags), events.Tags()["scalars"]
    assert "lm loss" in events.Tags()["scalars"]  # Megatron's own scalars beside them
    logged = run.output.split("megatron_ext expert load: worst EP-rank max_vio ")[1:]
    worst = [float(text.split()[0]) for text in logged]
    steps = {t: [(s.step, s.value) for s in events.Scalars(t)] for t in tags}
    for tag, points in steps.items():
        assert [step for step, _ in points] == [1, 2], (tag, points)
    per_step = [max(steps[t][i][1] for t in tags if t.endswith("rank_max_vio")) for i in (0, 1)]
    assert per_step == pytest.approx(worst, abs=5e-4)  # the printed line rounds to 3 digits
