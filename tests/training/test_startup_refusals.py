"""Tier: Megatron's real training loop (2 gloo ranks with torchrun's environment, CPU) and the entry's
dry run (rank 0 of the same world, no process group).

Each configuration below passes Megatron 0.19.2's ``validate_args``, and its ``pretrain`` stopped at
startup, before the first iteration: with a traceback on every rank (``TransformerConfig``'s
``__post_init__``, ``OptimizerParamScheduler``'s asserts, the optimizer's load) or with exit status 0
(a ``--load`` without a checkpoint trained from random weights; a corrupt tracker, a torch-format
checkpoint of other parallel sizes: Megatron's bare ``sys.exit()``); the dry run said OK for every
one. Now the dry run and the launch refuse each in the same one line, exit 2
(``megatron_ext/training/dry_run.py``, ``checkpoint_checks.py``, ``resume_checks.py``).

The checkpoints are Megatron's own: the tiny model trained 2 iterations and saved in ``torch``
(without its RNG state) and ``torch_dist`` format (at iterations 1 and 2). Each flag a refusal of a
changed ``--lr`` names is then passed, as it says, and the resume from iteration 1 trains with the
optimizer state it loaded; a resume's changed data and model flags are printed, one line each. A ``sys.exit()`` inside Megatron's ``load_checkpoint`` that no startup check
foresees (an RNG state missing from the checkpoint) exits 1, after Megatron's message.
"""

import json
import os
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch

K = 2  # the checkpoints' iteration (and --train-iters of the runs that saved them)
PREFIX = "megatron_ext: invalid arguments: "

#: (id, flags added to the tiny model's, what the one line says). ``{ckpt}``: the checkpoints' root.
CASES = [
    ("topk-1-without-pre-softmax", ["--moe-router-topk", "1"],
     "Please use --moe-router-pre-softmax when topk is 1."),
    ("expert-bias-under-softmax", ["--moe-router-enable-expert-bias"],
     "Expert bias for aux-loss-free routing only supports 'sigmoid'"),
    ("group-topk-without-groups", ["--moe-router-group-topk", "2"],
     "moe_router_num_groups must be specified"),
    ("experts-not-divisible-by-groups", ["--moe-router-group-topk", "1",
                                         "--moe-router-num-groups", "3"],
     "num_moe_experts (8) should be divisible by moe_router_num_groups (3)"),
    ("group-topk-above-groups", ["--moe-router-group-topk", "4", "--moe-router-num-groups", "2"],
     "moe_router_group_topk (4) should be smaller than moe_router_num_groups (2)"),
    ("warmup-past-decay", ["--lr-warmup-iters", "10"],
     "OptimizerParamScheduler refuses the LR schedule (AssertionError at "),
    ("warmup-equal-to-decay", ["--lr-warmup-iters", str(K)],
     "assert self.lr_warmup_steps < self.lr_decay_steps): the warmup (--lr-warmup-iters"),
    ("warmup-fraction-1", ["--lr-warmup-fraction", "1.0"],
     "assert self.lr_warmup_steps < self.lr_decay_steps"),
    ("warmup-init-above-lr", ["--lr-warmup-init", "0.01"],
     "assert self.init_lr <= self.max_lr): --lr-warmup-init must not exceed --lr"),
    ("weight-decay-falling", ["--start-weight-decay", "0.1", "--end-weight-decay", "0.01",
                              "--weight-decay-incr-style", "linear"],
     "assert self.end_wd >= self.start_wd): --end-weight-decay must not be below "
     "--start-weight-decay"),
    ("load-typo", ["--load", "{ckpt}/torhc"],
     "--load {ckpt}/torhc holds no checkpoint (the directory does not exist)"),
    ("pretrained-missing", ["--pretrained-checkpoint", "{ckpt}/base"],
     "--pretrained-checkpoint {ckpt}/base holds no checkpoint"),
    ("exit-on-missing-checkpoint", ["--load", "{ckpt}/fresh", "--save", "{ckpt}/fresh",
                                    "--save-interval", "1", "--exit-on-missing-checkpoint"],
     "--exit-on-missing-checkpoint: --load {ckpt}/fresh holds no checkpoint"),
    ("corrupt-tracker", ["--load", "{ckpt}/corrupt"],
     "latest_checkpointed_iteration.txt holds '2\\n3', not an iteration number"),
    ("tracker-ahead-of-the-files", ["--load", "{ckpt}/ahead"],
     "names iteration 7, but {ckpt}/ahead/iter_0000007 does not exist"),
    ("ckpt-step-not-saved", ["--load", "{ckpt}/torch", "--ckpt-step", "5"],
     "--ckpt-step 5 names iteration 5, but {ckpt}/torch/iter_0000005 does not exist"),
    ("not-a-checkpoint", ["--load", "{ckpt}/notes"],
     "unknown checkpoint format in {ckpt}/notes/iter_0000002"),
    ("torch-format-other-ep", ["--load", "{ckpt}/torch", "--ckpt-format", "torch",
                               "--expert-model-parallel-size", "1"],
     "torch-format checkpoint, one file per TP/PP/EP rank"),
    ("train-iters-changed", ["--load", "{ckpt}/torch_dist", "--train-iters", str(2 * K)],
     "with --train-iters 2 -> 4, --lr-decay-iters 2 -> 4: Megatron's OptimizerParamScheduler "
     "refuses it"),
    ("global-batch-changed", ["--load", "{ckpt}/torch_dist", "--global-batch-size", "4"],
     "with --global-batch-size 8 -> 4: Megatron's OptimizerParamScheduler refuses it"),
    ("lr-decay-iters-changed", ["--load", "{ckpt}/torch", "--ckpt-format", "torch",
                                "--lr-decay-iters", "3"],
     "with --lr-decay-iters 2 -> 3: Megatron's OptimizerParamScheduler refuses it"),
    ("lr-changed", ["--load", "{ckpt}/torch_dist", "--lr", "2e-3"],
     "with --lr 0.001 -> 0.002: Megatron's OptimizerParamScheduler refuses it"),
    ("warmup-changed", ["--load", "{ckpt}/torch_dist", "--lr-warmup-iters", "1"],
     "with --lr-warmup-iters 0 -> 1: Megatron's OptimizerParamScheduler refuses it"),
    ("torch-dist-other-ep", ["--load", "{ckpt}/torch_dist", "--expert-model-parallel-size", "1"],
     "--expert-model-parallel-size 2 -> 1 cannot resume the optimizer state"),
]  # fmt: skip


@pytest.fixture(scope="module")
def saved(corpus_prefix, tmp_path_factory) -> tuple[Path, LoopRun]:
    """Megatron's checkpoints of the tiny model at iteration K (``torch`` saved with
    ``--no-save-rng``; ``torch_dist`` by a job whose ``--load`` is also its ``--save``, still
    empty: returned with the root), and broken copies: a corrupt tracker, a tracker ahead of the
    files, an iteration directory holding no checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    launch(
        [*_base(corpus_prefix), "--save-interval", str(K), "--ckpt-format", "torch",
         "--save", str(root / "torch"), "--no-save-rng"]
    ).check()  # fmt: skip
    torch_dist = launch(_load_and_save(corpus_prefix, root / "torch_dist")).check()
    tracker = "latest_checkpointed_iteration.txt"
    assert (root / "torch" / tracker).read_text().strip() == str(K)
    shutil.copytree(root / "torch", root / "corrupt")
    (root / "corrupt" / tracker).write_text("2\n3")  # two jobs appended to one tracker
    shutil.copytree(root / "torch_dist", root / "ahead")
    (root / "ahead" / tracker).write_text("7")
    (root / "notes" / f"iter_{K:07d}").mkdir(parents=True)
    (root / "notes" / f"iter_{K:07d}" / "README.txt").write_text("moved to object storage\n")
    (root / "notes" / tracker).write_text(str(K))
    return root, torch_dist


@pytest.fixture(scope="module")
def ckpt(saved) -> Path:
    """The checkpoints' root (:func:`saved`)."""
    return saved[0]


def _load_and_save(prefix: str, directory: Path) -> list[str]:
    """A job whose ``--load`` is its ``--save``, saving a torch_dist checkpoint at iterations 1..K."""
    return [*_base(prefix), "--save-interval", "1", "--ckpt-format", "torch_dist",
            "--load", str(directory), "--save", str(directory)]  # fmt: skip


def _base(prefix: str) -> list[str]:
    return [*TINY_MOE_TEST_ARGS, "--data-path", prefix, "--train-iters", str(K)]


@pytest.mark.parametrize(("flags", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_what_stops_megatron_at_startup_fails_the_dry_run_and_the_launch_in_one_line(
    flags, message, ckpt, corpus_prefix
) -> None:
    argv = _base(corpus_prefix) + [f.format(ckpt=ckpt) for f in flags]
    expected = message.format(ckpt=ckpt)
    # The dry run (one rank, no process group) beside the launch: each is mostly startup.
    with ThreadPoolExecutor(max_workers=1) as beside:
        dry_run = beside.submit(launch, [*argv, "--dry-run"], ranks=(0,))
        run = launch(argv)
        dry = dry_run.result()
    lines = dry.output.splitlines()
    refusals = [line for line in lines if line.startswith(PREFIX)]
    assert dry.returncode == 2 and len(refusals) == 1, dry.output[-3000:]
    assert expected in refusals[0], refusals[0]
    assert "dry run OK" not in dry.output and "Traceback" not in dry.output
    assert run.returncode == 2, run.output[-3000:]
    assert dry.preloaded and run.preloaded, (
        dry.not_forked_because,
        run.not_forked_because,
    )  # forked: no test before left its environment behind
    assert not run.iterations  # nothing trained
    # A rank refuses with the dry run's line, before any process group or model (the first to
    # exit stops the other, as torchrun's agent does: it may not have printed yet).
    assert refusals[0] in run.output.splitlines(), run.output[-3000:]


def test_there_are_at_least_twenty_distinct_configurations() -> None:
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


def test_a_load_directory_that_is_also_save_starts_from_iteration_0(
    saved, corpus_prefix, tmp_path
) -> None:
    """A job that resumes itself after a restart: the first launch (the fixture's torch_dist save)
    finds nothing, says so in one line, trains and saves; the relaunch (the same flags, on a copy
    of that directory) resumes from that checkpoint."""
    root, first = saved
    note = f"megatron_ext: --load {root / 'torch_dist'} holds no checkpoint yet"
    assert [line for line in first.output.splitlines() if line.startswith(note)] == [
        f"{note} (the directory does not exist; it is also --save): training starts from "
        "iteration 0"
    ]
    assert sorted(first.iterations) == [1, 2]
    shutil.copytree(root / "torch_dist", tmp_path / "c")
    again = launch(_load_and_save(corpus_prefix, tmp_path / "c")).check()
    assert "holds no checkpoint yet" not in again.output
    assert "megatron_ext: resuming" not in again.output  # the same flags: no change to name
    assert f"checkpoint from {tmp_path / 'c'} at iteration {K}" in again.output


def test_a_load_failure_no_startup_check_foresees_exits_1_after_megatrons_message(
    ckpt, corpus_prefix
) -> None:
    """A torch-format checkpoint saved with --no-save-rng (the fixture's), loaded without
    --no-load-rng: on every rank Megatron's ``load_checkpoint`` prints "Unable to load rng state
    from checkpoint ... Specify --no-load-rng" and calls ``sys.exit()``: the launch trained nothing
    and exited 0. Now each rank exits 1 after Megatron's message."""
    run = launch([*_base(corpus_prefix), "--ckpt-format", "torch", "--load", str(ckpt / "torch")])
    assert run.returncode == 1, run.output[-3000:]
    assert "Unable to load rng state from checkpoint" in run.output
    assert "megatron_ext: Megatron stopped while loading the checkpoint" in run.output
    assert not run.iterations


#: The tiny model's arguments as the model check reads them (TINY_MOE_ARGS).
TINY_MODEL = dict(hybrid_layer_pattern=None, num_layers=2, hidden_size=64, num_experts=8,
                  transformer_impl="local")  # fmt: skip


def _found(directory: Path):
    import argparse

    from megatron_ext.training.checkpoint_checks import find_checkpoint

    return find_checkpoint(str(directory), "--load", None, argparse.Namespace())


def _broken_copy(ckpt: Path, name: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of one of the fixture's checkpoints and its iteration directory."""
    shutil.copytree(ckpt / name, tmp_path / name)
    return tmp_path / name, tmp_path / name / f"iter_{K:07d}"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate __1_0.distcp", r"__1_0\.distcp is truncated \(1000 bytes; .*/\.metadata "
                                  r"indexes \d+\): Megatron would stop with 'EOFError"),
        ("truncate __0_0.distcp", r"__0_0\.distcp is truncated \(1000 bytes"),
        ("remove __1_0.distcp", r"__1_0\.distcp cannot be read \(No such file or directory\)"),
        ("remove .metadata", r"iter_0000002/\.metadata is missing \(the index of every tensor"),
        ("truncate .metadata", r"iter_0000002/\.metadata cannot be read \("),
    ],
)  # fmt: skip
def test_a_damaged_torch_dist_checkpoint_is_refused_naming_the_file(
    damage, message, ckpt, tmp_path
) -> None:
    """Megatron's own torch_dist checkpoint, damaged: the load died on every rank with
    ``EOFError: Ran out of input`` (naming no file) or ``metadata is None``; the dry run said OK.
    Now one line names the file, read from the ``.metadata`` index without a tensor."""
    from megatron_ext.training.checkpoint_checks import check_checkpoint_files

    directory, iteration = _broken_copy(ckpt, "torch_dist", tmp_path)
    action, name = damage.split()
    if action == "remove":
        (iteration / name).unlink()
    else:
        os.truncate(iteration / name, 1000)
    found = _found(directory)
    with pytest.raises(ValueError, match=message) as err:
        check_checkpoint_files(found)
    assert str(err.value).startswith(f"--load {directory} (iteration {K}): ")
    assert "\n" not in str(err.value)


def test_a_truncated_torch_checkpoint_file_is_refused_naming_it(ckpt, tmp_path) -> None:
    from megatron_ext.training.checkpoint_checks import check_checkpoint_files

    directory, iteration = _broken_copy(ckpt, "torch", tmp_path)
    check_checkpoint_files(_found(directory))  # whole: passes
    cut = iteration / "mp_rank_00_001" / "model_optim_rng.pt"
    os.truncate(cut, cut.stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{cut} cannot be read \\(BadZipFile: "):
        check_checkpoint_files(_found(directory))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("torch_dist", {}, None),
        ("torch", {}, None),
        ("torch_dist", {"num_layers": 4}, "--num-layers 2 -> 4"),
        ("torch_dist", {"hidden_size": 128}, "--hidden-size 64 -> 128"),
        ("torch_dist", {"num_experts": 4}, "--num-experts 8 -> 4"),
        ("torch_dist", {"num_experts": None}, "--num-experts 8 -> None"),
        ("torch_dist", {"hybrid_layer_pattern": "*E*E*E*E"},
         "--num-layers 2 -> --hybrid-layer-pattern '*E*E*E*E' (it pairs with a GPTModel of 4"),
        ("torch_dist", {"hybrid_layer_pattern": "*E*E"},
         "class GPTModel -> HybridModel with --transformer-impl local"),
        ("torch_dist", {"hybrid_layer_pattern": "*E*E", "transformer_impl": "transformer_engine"},
         None),  # Megatron 0.19.2 maps the GPT layers onto TE's (not run here)
        ("torch", {"hybrid_layer_pattern": "*E*E"}, "class GPTModel -> HybridModel (Megatron "
         "maps GPT layers only from torch_dist)"),
        ("torch", {"padded_vocab": 512}, "padded vocabulary 384 -> 512"),
        ("torch_dist", {"padded_vocab": 512}, None),  # loads into another padded vocabulary
    ],
)  # fmt: skip
def test_a_checkpoint_of_another_model_is_refused_naming_the_first_difference(
    name, change, message, ckpt
) -> None:
    """The tiny GPTModel's own checkpoints under other model flags. Each refused one was run
    for real when this check was written: Megatron failed after building the model (shape
    mismatches; GPT into HybridModel: RuntimeError, or KeyError with local modules; a torch
    file's load_state_dict size mismatch); the unrefused ones trained."""
    import argparse

    from megatron_ext.training.checkpoint_checks import (
        check_checkpoint_model,
        maps_gpt_layers_to_hybrid,
    )

    if "hybrid_layer_pattern" in change and not maps_gpt_layers_to_hybrid():  # 0.18.2: none maps
        message = "class GPTModel -> HybridModel (megatron-core before 0.19 maps no GPT"
    model = {**TINY_MODEL, **change}
    padded = model.pop("padded_vocab", 384)
    found = _found(ckpt / name)
    if message is None:
        check_checkpoint_model(argparse.Namespace(**model), found, padded)
        return
    with pytest.raises(ValueError) as err:
        check_checkpoint_model(argparse.Namespace(**model), found, padded)
    line = str(err.value)
    assert line.startswith(f"--load {ckpt / name} (iteration {K}) holds another model: "), line
    assert message in line and "\n" not in line, line


def test_a_base_checkpoint_of_another_model_fails_the_dry_run_in_one_line(
    ckpt, corpus_prefix
) -> None:
    """The issue's case on the tiny model: a GPTModel checkpoint as the base of a HybridModel
    run. The dry run said OK; the launch printed about 180 lines ending in KeyError."""
    argv = [*_base(corpus_prefix), "--hybrid-layer-pattern", "*E*E", "--pretrained-checkpoint",
            str(ckpt / "torch_dist"), "--dry-run"]  # fmt: skip
    from megatron_ext.training.checkpoint_checks import maps_gpt_layers_to_hybrid

    dry = launch(argv, ranks=(0,))
    refusals = [line for line in dry.output.splitlines() if line.startswith(PREFIX)]
    assert dry.returncode == 2 and len(refusals) == 1, dry.output[-3000:]
    why = (
        "with --transformer-impl local (Megatron 0.19.2 maps a GPT checkpoint's layers onto "
        "Transformer Engine ones only: the local layer norms' keys differ)"
        if maps_gpt_layers_to_hybrid()
        else "(megatron-core before 0.19 maps no GPT checkpoint's layers onto a HybridModel)"
    )
    assert refusals[0] == (
        f"{PREFIX}--pretrained-checkpoint {ckpt / 'torch_dist'} (iteration {K}) holds another "
        f"model: class GPTModel -> HybridModel {why}; Megatron would fail loading it after "
        "building the model. Name a checkpoint of this model, or match its flags"
    )
    assert "Traceback" not in dry.output


@pytest.mark.each_megatron
def test_each_flag_an_lr_change_refusal_names_resumes_with_the_optimizer_state(
    ckpt, corpus_prefix, tmp_path
) -> None:
    """A resume from iteration 1 with --lr doubled is refused naming two flags; passed as the
    refusal says, each resumes (Megatron 0.19.2 stopped in the optimizer's load with 'Could not
    find parameter group' under either) and trains iteration 2 with the Adam moments it loaded.
    --use-checkpoint-opt_param-scheduler keeps the checkpoint's LR: its iteration-2 checkpoint is
    the uninterrupted run's (the fixture's), bit for bit. --override-opt_param-scheduler trains at
    the new LR: the moments are the uninterrupted run's bit for bit (iteration 2's gradient does
    not depend on its LR; moments restarted from zero would differ), and the weights took twice
    its step (AdamW's step, weight decay included, is linear in the LR)."""
    loaded = ckpt / "torch_dist"
    # --adam-beta2 too: its line says the loaded optimizer keeps the checkpoint's, and the
    # moments below (exp_avg_sq is beta2's) show it.
    argv = [*_base(corpus_prefix), "--ckpt-format", "torch_dist", "--load", str(loaded),
            "--ckpt-step", "1", "--lr", "2e-3", "--adam-beta2", "0.95"]  # fmt: skip
    dry = launch([*argv, "--dry-run"], ranks=(0,))
    refusals = [line for line in dry.output.splitlines() if line.startswith(PREFIX)]
    assert dry.returncode == 2 and len(refusals) == 1, dry.output[-3000:]
    named = re.findall(r"(?:pass|or) (--[\w-]+) to ", refusals[0])
    assert named == ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]
    saves = {flag: [*argv, flag, "--save", str(tmp_path / flag), "--save-interval", str(K)]
             for flag in named}  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(named, pool.map(launch, saves.values()), strict=True))
    for flag, run in runs.items():
        run.check()
        assert sorted(run.iterations) == [K], flag
    override, kept = (runs[f] for f in named)
    assert override.iterations[K]["learning rate"] == 2e-3
    assert kept.iterations[K]["learning rate"] == 1e-3
    where = f"megatron_ext: resuming --load {loaded} (iteration 1): "
    assert (
        f"{where}--lr 0.001 -> 0.002 (not applied: --use-checkpoint-opt_param-scheduler "
        "keeps the checkpoint's)" in kept.output.splitlines()
    )
    assert f"{where}--lr 0.001 -> 0.002 (the checkpoint's -> this run's)" in override.output
    for run in runs.values():
        assert (
            f"{where}--adam-beta2 0.999 -> 0.95 (not applied: the loaded optimizer keeps the "
            "checkpoint's; --no-load-optim restarts it with this run's)" in run.output.splitlines()
        )
    at_1, at_k = (_torch_dist_state(loaded / f"iter_{i:07d}", tmp_path / f"{i}.pt") for i in (1, K))
    kept_state = _torch_dist_state(tmp_path / named[1] / f"iter_{K:07d}", tmp_path / "kept.pt")
    assert kept_state.keys() == at_k.keys()
    assert [k for k in at_k if not _equal(at_k[k], kept_state[k])] == []
    new = _torch_dist_state(tmp_path / named[0] / f"iter_{K:07d}", tmp_path / "override.pt")
    weights = [k for k in at_k if not k.startswith("optimizer.")]
    moments = [k for k in at_k if ".exp_avg" in k]
    assert len(moments) == 2 * len(weights) >= 20  # both Adam moments of every weight
    assert [k for k in moments if not _equal(at_k[k], new[k])] == []
    # Not vacuous: the moments loaded at iteration 1 are not zero (a restart would drop them).
    assert all(at_1[k].abs().sum() > 0 for k in moments if "exp_avg_sq" not in k)
    for k in weights:
        # Float32 weights near 1 (norms) hold a step of ~1e-3 to about 1e-7.
        torch.testing.assert_close(at_1[k] - new[k], 2 * (at_1[k] - at_k[k]), rtol=1e-3, atol=5e-7)


def _torch_dist_state(iter_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A torch_dist checkpoint's tensors, by flat key, read with torch alone."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():  # "no process group: loading in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_to_torch_save(iter_dir, scratch)
    state = torch.load(scratch, map_location="cpu", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def test_a_resume_names_each_data_and_model_flag_it_changes(ckpt, corpus_prefix) -> None:
    """Megatron resumes with another top-k, pad policy, sequence length or seed and said nothing;
    now each changed flag the checkpoint recorded is one line (the launch prints the dry run's
    notes), and nothing else is: paths, intervals and what Megatron derives after startup are not
    flags the run changed."""
    loaded = ckpt / "torch_dist"
    changes = ["--moe-router-topk", "3", "--pad-policy", "constant", "--seq-length", "64",
               "--seed", "8", "--save", str(ckpt / "elsewhere"), "--save-interval", "5",
               "--log-interval", "2"]  # fmt: skip
    dry = launch([*_base(corpus_prefix), "--ckpt-format", "torch_dist", "--load", str(loaded),
                  *changes, "--dry-run"], ranks=(0,))  # fmt: skip
    assert dry.returncode == 0, dry.output[-3000:]
    out = dry.output
    start = out.index("megatron_ext resolved configuration:\n")
    notes = json.loads(out[start:].split("\n", 1)[1].split("megatron_ext: dry run OK")[0])["notes"]
    where = f"resuming --load {loaded} (iteration {K})"
    order = f"the samples continue after the {K * 8} consumed in this run's sample order, not the "
    assert notes == [
        f"{where}: --moe-router-topk 2 -> 3 (the checkpoint's -> this run's)",
        f"{where}: --seed 7 -> 8 (the checkpoint's -> this run's; {order}checkpoint's)",
        f"{where}: --seq-length 128 -> 64 (the checkpoint's -> this run's; {order}checkpoint's)",
        f"{where}: --pad-policy self -> constant (the checkpoint's -> this run's)",
    ]
