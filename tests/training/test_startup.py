"""Tier: pure + a subprocess on the pinned wheel. The entry point does not run Megatron's ``make`` when the
wheel's prebuilt dataset helpers import; otherwise Megatron's own ``compile_helpers`` runs unchanged."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_ext.training import startup


def test_the_pinned_wheel_really_fails_megatrons_make():
    # The failure the skip exists for: the wheel has helpers_cpp but no Makefile, so make fails and
    # Megatron exits (status 1) from compile_helpers.
    code = "from megatron.core.datasets.utils import compile_helpers; compile_helpers()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert startup.prebuilt_helpers_available()


@pytest.fixture
def datasets_utils(monkeypatch):
    import megatron.core.datasets.utils as utils

    calls = []
    monkeypatch.setattr(utils, "compile_helpers", lambda: calls.append("make"))
    return utils, calls


def test_prebuilt_helpers_skip_make(datasets_utils):
    utils, calls = datasets_utils
    startup.skip_helpers_build_when_prebuilt()
    startup.skip_helpers_build_when_prebuilt()  # idempotent: wrapped once
    assert utils.compile_helpers() is None
    assert calls == []


def test_without_prebuilt_helpers_megatron_builds_them(datasets_utils, monkeypatch):
    utils, calls = datasets_utils
    startup.skip_helpers_build_when_prebuilt()
    monkeypatch.setattr(startup, "prebuilt_helpers_available", lambda: False)
    utils.compile_helpers()
    assert calls == ["make"]


# ----------------------------------------------------------------------------- the --cpu launch

# A fresh interpreter with the user's Dynamo (enabled), with or without what a --cpu launch does
# before Megatron's import (``prepare_cpu_launch``): the jit fuser run eagerly, the tokenizer
# libraries deferred. One interpreter per side checks both: each is decided at import.
_IMPORTS_IN_A_FRESH_PROCESS = """
import os
import sys
os.environ.pop("TORCHDYNAMO_DISABLE", None)
from megatron_ext.training import startup
cpu = {cpu}
if cpu:
    startup.run_jit_fuser_eagerly()
    assert startup.defer_tokenizer_libraries()
    assert not startup.defer_tokenizer_libraries()  # idempotent
from megatron.core.fusions import fused_bias_swiglu
print(hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"))
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText
import megatron.core.tokenizers.text.libraries as libraries
before = "transformers" in sys.modules
null = libraries.NullTokenizer(vocab_size=257)
after_null = "transformers" in sys.modules
hf = libraries.HuggingFaceTokenizer
from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
assert hf is HuggingFaceTokenizer and null.vocab_size == 257
print(before, after_null, "transformers" in sys.modules, sorted(libraries.__all__ if cpu else
      [n for n in vars(libraries) if n.endswith("Tokenizer")]))
"""


def _fresh_stdout(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (which must exit 0)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def fresh_imports() -> dict[bool, tuple[str, list[str]]]:
    """Per side (True: as a --cpu launch prepares it): whether Megatron's swiglu is compiled, and
    the tokenizer libraries' report (transformers imported before/after a NullTokenizer/after
    naming the Hugging Face class, the library names)."""
    sides = (False, True)
    with ThreadPoolExecutor(max_workers=2) as pool:  # two single-threaded interpreters, 2 cores
        outputs = pool.map(
            _fresh_stdout, [_IMPORTS_IN_A_FRESH_PROCESS.format(cpu=c) for c in sides]
        )
    reports = {}
    for cpu, stdout in zip(sides, outputs, strict=True):
        compiled, libraries = stdout.split("\n", 1)
        reports[cpu] = (compiled, libraries.split(maxsplit=3))
    return reports


def test_deferred_tokenizer_libraries_import_transformers_only_when_named(fresh_imports):
    # Megatron's own package __init__ (megatron-core 0.19.2) imports transformers for every launch ...
    eager = fresh_imports[False][1]
    assert eager[:3] == ["True", "True", "True"]
    # ... deferred, a NullTokenizer is built without it, and naming the Hugging Face class imports it.
    deferred = fresh_imports[True][1]
    assert deferred[:3] == ["False", "False", "True"]
    assert deferred[3] == eager[3]  # the same seven names, from the same submodules


def test_a_changed_libraries_init_is_refused(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text("from a.b import C\nfrom a.d import E as F\n")
    assert startup._library_exports(init) == {"C": "a.b", "F": "a.d"}
    init.write_text("from a.b import C\nREGISTRY = {}\n")
    with pytest.raises(RuntimeError, match="no longer a list"):
        startup._library_exports(init)


@pytest.mark.parametrize("eager", [False, True])
def test_cpu_launch_runs_jit_fuser_functions_eagerly(eager, fresh_imports):
    # Megatron's jit_fuser is torch.compile: the function is wrapped unless Dynamo is disabled.
    assert fresh_imports[eager][0] == str(not eager)


def test_a_users_cpu_launch_imports_no_hugging_face_and_trains_as_the_tests_do(corpus_prefix):
    from megatron_ext.testing.real_loop import TINY_MOE_ARGS, TINY_MOE_TEST_ARGS, launch
    from tests.training.entry_args import ROOT

    # Fresh interpreters (not forked from the preloaded server) in a user's shell (Dynamo enabled,
    # against the tests' TORCHDYNAMO_DISABLE=1) with Megatron's default dataloader workers: what a
    # user's torchrun ranks import and train. The tests' launches (forked, batches built in the
    # rank: TINY_MOE_TEST_ARGS) must train the same.
    # A Hugging Face tokenizer still works: tests/tools/test_hf_tokenizer.py trains with one.
    data = ["--data-path", corpus_prefix, "--train-iters", "2"]
    plain = launch([*TINY_MOE_ARGS, *data], module="tests.training.imports_probe",
                   env={"TORCHDYNAMO_DISABLE": "0"}, preload=False, cwd=ROOT).check()  # fmt: skip
    assert not plain.preloaded and sorted(plain.losses) == [1, 2]
    reports = [line for line in plain.output.splitlines() if line.startswith("imported:")]
    hf_module = "megatron.core.tokenizers.text.libraries.huggingface_tokenizer"
    expected = f"imported: transformers=False {hf_module}=False"
    assert reports == [expected] * 2, plain.output[-3000:]
    assert plain.output.count("runs Megatron's jit_fuser functions eagerly") == 1  # rank 0's line
    assert plain.output.count("dataloader workers: 2") == 2  # Megatron's default, on each rank
    tested = launch([*TINY_MOE_TEST_ARGS, *data]).check()
    assert tested.preloaded
    assert plain.losses == tested.losses  # bitwise: the logged digits are equal


_FAULTS_AFTER_STARTUP = """
import resource, torch
from megatron_ext.training.startup import prepare_cpu_launch
prepare_cpu_launch({caching})

def faults_per_trip():
    # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB): a fresh mmap by default.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        x = torch.ones(16 * 2**20)
        del x
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5

faults_per_trip()  # the heap grows to its working size first
print(min(faults_per_trip() for _ in range(3)))
"""


def test_cpu_startup_keeps_freed_memory_unless_turned_off():
    sides = (True, False)
    with ThreadPoolExecutor(max_workers=2) as pool:  # page faults are per process: side by side
        outputs = pool.map(_fresh_stdout, [_FAULTS_AFTER_STARTUP.format(caching=c) for c in sides])
    faults = {
        caching: int(stdout.split()[-1]) for caching, stdout in zip(sides, outputs, strict=True)
    }
    # 4 KiB pages: 16384 faults a trip under glibc's defaults (32 under transparent huge pages);
    # with freed memory kept, none once warm (a stray fault or two is allowed).
    assert faults[False] >= 32, faults
    assert 8 * faults[True] <= faults[False], faults


def test_cpu_caching_malloc_changes_no_loss(corpus_prefix):
    from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch

    args = [*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "3"]
    runs = {
        flags: launch([*args, *flags], module="tests.training.loss_probe").check()
        for flags in ((), ("--no-cpu-caching-malloc",))
    }
    kept, default = runs[()], runs[("--no-cpu-caching-malloc",)]
    assert kept.output.count("malloc keeps freed memory for reuse") == 1  # rank 0's startup line
    assert "malloc keeps freed memory" not in default.output
    probes = {
        flags: sorted(line for line in run.output.splitlines() if line.startswith("loss probe:"))
        for flags, run in runs.items()
    }
    # Each rank's micro-batch loss sums as repr() printed them (every bit), 3 iterations.
    assert len(probes[()]) >= 2 * 3, kept.output[-3000:]
    assert probes[()] == probes[("--no-cpu-caching-malloc",)]
    assert sorted(kept.losses) == [1, 2, 3] and kept.losses == default.losses


# ----------------------------------------------------------------------------- torch_dist saves


def test_only_a_run_saving_torch_dist_forks_the_checkpoint_results_queue(monkeypatch):
    from argparse import Namespace

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    for save, ckpt_format in ((None, "torch_dist"), ("/ckpt", "torch"), ("/ckpt", "fsdp_dtensor")):
        assert not startup.fork_checkpoint_results_queue(
            Namespace(save=save, ckpt_format=ckpt_format)
        )
    assert filesystem_async._results_queue is None
    assert startup.fork_checkpoint_results_queue(Namespace(save="/ckpt", ckpt_format="torch_dist"))
    queue = filesystem_async.get_write_results_queue()  # as the writer asks (spawn by default)
    try:
        assert queue is filesystem_async._results_queue
        assert type(queue._manager._process).__name__ == "ForkProcess"
        queue.put({"written": torch.arange(3)})  # what a save sends: torch objects, pickled
        assert queue.get()["written"].tolist() == [0, 1, 2]
    finally:
        queue._manager.shutdown()


def test_a_cpu_launch_saving_torch_dist_saves_through_the_forked_queue(corpus_prefix, tmp_path):
    from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch

    ckpt = tmp_path / "ckpt"  # Megatron's default --ckpt-format: torch_dist
    args = [*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "1",
            "--save", str(ckpt), "--save-interval", "1"]  # fmt: skip
    run = launch(args, module="tests.training.save_queue_probe").check()
    assert "in torch_dist format" in run.output
    assert run.output.count("results queue: ForkProcess") == 2, run.output[-3000:]  # each rank's
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


_QUEUE_THEN_KILLED = """
import os, signal
from argparse import Namespace
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_ext.training import startup
assert startup.fork_checkpoint_results_queue(Namespace(save="/ckpt", ckpt_format="torch_dist"))
print(filesystem_async._results_queue._manager._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as a rank stopped by a signal: no exit handler runs
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)
def test_the_forked_manager_dies_with_a_killed_rank(tmp_path):
    out = tmp_path / "out"  # a file, not a pipe: a surviving manager would hold a pipe open
    with open(out, "w") as stdout:
        code = subprocess.run([sys.executable, "-c", _QUEUE_THEN_KILLED], stdout=stdout,
                              stderr=subprocess.STDOUT, timeout=120).returncode  # fmt: skip
    assert code == -9, out.read_text()[-3000:]
    pid = int(out.read_text().split()[-1])
    try:
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid), "the results queue's manager outlived the killed rank"
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
