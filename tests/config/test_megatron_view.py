"""The typed view of Megatron's arguments (pure; one test parses with Megatron 0.19.2's real parser).

The defaults are checked against ``megatron.training.arguments.parse_args`` (megatron-core 0.19.2,
``megatron/training/arguments.py``) on a command line without flags, with megatron_ext's flags added
as a launch adds them.
"""

import argparse
import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from megatron_ext.config.megatron_view import MegatronView, TrainingProgress, field_default

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ext"

#: Where ``getattr(args, ...)`` may still read a namespace, how many times, and why. Everything
#: else reads Megatron's flags through MegatronView and megatron_ext's own through the feature
#: configs (or ``flag_value``, their one reader with the field's default).
READ_ARGS: dict[str, tuple[int, str]] = {
    "config/megatron_view.py": (1, "builds the view: an absent attribute is the field's default"),
    "config/registry.py": (1, "flag_value: megatron_ext's own flags, with the field's default"),
    "training/launch_rules.py": (1, "builds the feature configs; a flag absent is refused"),
    "training/resume_checks.py": (
        1,
        "compares this run's arguments with the checkpoint's, dest by dest (any dest saved)",
    ),
    "moe/config.py": (1, "rehearsed_precision: megatron_ext's own mark, set by a --cpu rehearsal"),
    "rehearse/demo.py": (1, "--overwrite of megatron-ext demo's own parser, not Megatron's"),
}

#: The issue's bound on what is left (issue 45): at most this many reads in all.
MOST_READS = 10

_GETATTR_ARGS = re.compile(r"getattr\(\s*args\b")


def test_defaults_equal_megatrons_parser_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field is an attribute of Megatron's parsed arguments, with the field's default."""
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # parse_args reads world_size from it
    parsed = parse_args(extra_args_provider=add_megatron_ext_args)
    fields = dataclasses.fields(MegatronView)
    missing = [f.name for f in fields if not hasattr(parsed, f.name)]
    assert missing == []
    differ = {
        f.name: (field_default(f), getattr(parsed, f.name))
        for f in fields
        if getattr(parsed, f.name) != field_default(f)
    }
    assert differ == {}
    # Not vacuous: some defaults are values, not None/False, and they went through the parser.
    assert {f.name for f in fields if field_default(f) not in (None, False)} >= {
        "fp8_recipe",
        "fp4_recipe",
        "eval_iters",
        "transformer_impl",
        "moe_router_topk",
    }
    assert MegatronView.from_args(parsed) == MegatronView()


def test_from_args_reads_set_values_and_defaults_the_rest() -> None:
    """A value on the namespace is taken as is; an attribute it lacks reads as the one default."""
    view = MegatronView.from_args(argparse.Namespace(fp8="e4m3", load="/ckpt", no_load_optim=True))
    assert (view.fp8, view.load, view.no_load_optim) == ("e4m3", "/ckpt", True)
    assert (view.fp8_recipe, view.mid_level_dataset_surplus, view.save) == ("delayed", 0.005, None)
    assert MegatronView.from_args(argparse.Namespace()) == MegatronView()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.load = "/other"  # type: ignore[misc]


def test_training_progress_reads_none_and_absent_as_zero() -> None:
    """Megatron's loop counters: absent (before its loop sets them) or None read as 0."""
    assert TrainingProgress.from_args(argparse.Namespace()) == TrainingProgress()
    none = argparse.Namespace(iteration=None, curr_iteration=None, consumed_train_samples=None)
    assert TrainingProgress.from_args(none) == TrainingProgress(iteration=0)
    set_ = argparse.Namespace(iteration=4, curr_iteration=6, consumed_train_samples=48)
    progress = TrainingProgress.from_args(set_)
    assert (progress.iteration, progress.curr_iteration, progress.consumed_train_samples) == (
        4,
        6,
        48,
    )


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body)."""
    body = next(
        node.body
        for node in ast.parse((PACKAGE / "config" / "megatron_view.py").read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__
    )
    return {
        node.target.id: after.value.value
        for node, after in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    }


def test_every_field_names_its_megatron_flag() -> None:
    """A field's docstring opens with the Megatron option whose dest it is (checked on Megatron's
    own parser), or says it is not a flag."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dest_of = {
        option: action.dest for action in parser._actions for option in action.option_strings
    }
    docs = _field_docs(MegatronView)
    assert set(docs) == {f.name for f in dataclasses.fields(MegatronView)}
    not_flags = set()
    for name, doc in docs.items():
        named = re.match(r"``(--[a-z0-9-]+)``", doc)
        if named is None:
            assert doc.startswith("Not a flag"), (name, doc)
            not_flags.add(name)
            continue
        assert dest_of.get(named.group(1)) == name, (name, named.group(1))
    # What Megatron sets on its arguments itself: the padded vocabulary (when it builds its
    # tokenizer) and the world size (parse_args, from WORLD_SIZE).
    assert not_flags == {"padded_vocab_size", "world_size"}
    assert set(_field_docs(TrainingProgress)) == {
        f.name for f in dataclasses.fields(TrainingProgress)
    }


def test_no_module_below_the_entry_reads_megatrons_namespace() -> None:
    """Megatron's arguments are read through the view or the feature configs: ``getattr(args,
    ...)`` (each with its own default) appears only where READ_ARGS says, as often as it says,
    at most MOST_READS times in all."""
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 50  # the package, not an empty directory
    reading = {
        path.relative_to(PACKAGE).as_posix(): len(_GETATTR_ARGS.findall(path.read_text()))
        for path in sources
    }
    reading = {path: count for path, count in reading.items() if count}
    # The list is exact: a module that reads more, fewer or none is named.
    assert reading == {path: count for path, (count, _why) in READ_ARGS.items()}
    assert sum(reading.values()) <= MOST_READS
    assert all(why for _count, why in READ_ARGS.values())
