"""Checks the real-loop tests share (not a test module): what a launch of Megatron's real
``pretrain`` must show, read off what it logged (:class:`megatron_ext.testing.real_loop.LoopRun`).

Used by tests/training/test_real_loop_examples.py (the examples' scripts under ``CPU=1``) and
tests/training/test_real_loop_features.py (the tiny model's feature matrix): the tiny model's sizes
(``ITERATIONS``, ``EXPERTS``/``TOPK``/``MOE_LAYERS``), ``VERBOSE``, and :func:`assert_trains` (exit 0,
``ITERATIONS`` finite, falling losses), :func:`built_model` (the model class the loop built),
:func:`field_per_iteration` and :func:`expert_load_lines` (an iteration field, the expert-load lines),
and :func:`without` (a launch's argv with a flag and its value left out; also
tests/training/test_real_loop_padding.py).
"""

import math
import re

from megatron_ext.testing.real_loop import LoopRun

#: Shows the warnings megatron_ext hides by default, GPTModel's deprecation among them (built_model).
VERBOSE = "--verbose"
ITERATIONS = 4
EXPERTS, TOPK, MOE_LAYERS = 8, 2, 2  # CPU_SIZES in examples/_launch.sh and TINY_MOE_TEST_ARGS


def assert_trains(run: LoopRun) -> dict[int, float]:
    """Exit 0 and ``ITERATIONS`` logged iterations of finite ``lm loss``, the last below the first."""
    if run.returncode != 0:
        # Every rank's exception line first: the tail is often only the peer's "connection closed".
        errors = dict.fromkeys(re.findall(r"^.*\b\w+(?:Error|Exception): .*$", run.output, re.M))
        raise AssertionError("\n".join(["launch failed:", *errors, *run.output.splitlines()[-30:]]))
    losses = run.losses
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), run.output[-3000:]
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[ITERATIONS] < losses[1], losses
    # A forked rank runs its module fresh, as ``python -m`` does (runpy warns when it was preloaded).
    assert "found in sys.modules" not in run.output
    # Every run here is dropless alltoall/allgather (expert TP 1 under TP 2): pads skip dispatch.
    assert "megatron_ext: --moe-pad-routing skip (auto" in run.output, run.output[-3000:]
    return losses


def built_model(run: LoopRun) -> str:
    """The model class the loop built, from what Megatron logged while building it (``--verbose``):
    every HybridModel logs its layer allocation (``HybridModel: pp_rank=.. layers='*E*E'``), every
    GPTModel its deprecation (``GPTModel.__init__``; on megatron-core 0.18.2, which has none,
    megatron_ext's GPT builder logs it builds one); exactly one of the two must be there."""
    assert re.search(r"^ *verbose \.+ True$", run.output, re.M), "built_model needs --verbose"
    hybrid = re.findall(r"HybridModel: pp_rank=\d+/\d+, .*layers='([^']*)'", run.output)
    gpt = "GPTModel IS DEPRECATED" in run.output or "building GPTModel ..." in run.output
    assert bool(hybrid) != gpt, (hybrid, gpt, run.output[-3000:])
    return "HybridModel" if hybrid else "GPTModel"


def field_per_iteration(run: LoopRun, name: str) -> list[float]:
    """A field of Megatron's iteration line at every iteration (asserting it is logged each time)."""
    values = [run.iterations[i].get(name) for i in sorted(run.iterations)]
    assert all(v is not None and math.isfinite(v) and v > 0 for v in values), (name, values)
    return values


def expert_load_lines(run: LoopRun) -> list[float]:
    """megatron_ext's per-log-interval ``worst EP-rank max_vio`` (EP=2: between 0 and 1)."""
    found = re.findall(r"megatron_ext expert load: .*max_vio ([0-9.]+)", run.output)
    values = [float(v) for v in found]
    # One line per logged iteration (the last one too, or not: when the next step would start).
    assert len(values) in (ITERATIONS - 1, ITERATIONS), run.output[-3000:]
    assert all(0.0 <= v <= 1.0 for v in values) and any(v > 0 for v in values), values
    return values


def without(argv: list[str], flag: str) -> list[str]:
    """``argv`` with every ``flag VALUE`` pair left out."""
    drop = {i for i, a in enumerate(argv) if a == flag} | {
        i + 1 for i, a in enumerate(argv) if a == flag
    }
    return [a for i, a in enumerate(argv) if i not in drop]
