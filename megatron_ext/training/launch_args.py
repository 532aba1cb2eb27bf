"""Argument-time checks of what Megatron 0.19.2 accepts in ``validate_args`` but fails on later.

Each check names the flags and says what to set; without it the run fails after startup (the
expert process grid, in ``initialize_model_parallel``) or after the model is built (the sample
counts, in ``get_train_valid_test_num_samples``), on every rank, with a traceback.
"""

import argparse


def check_launch_args(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the flags of the first combination Megatron would fail on."""
    _check_expert_grid(args)
    _check_eval_interval(args)
    _check_learning_rate(args)


def builds_optimizer(args: argparse.Namespace) -> bool:
    """Whether Megatron's ``setup_model_and_optimizer`` builds the optimizer and its LR scheduler:
    not under ``--skip-train`` (evaluation only), unless an RL step loads the optimizer."""
    rl_optimizer = getattr(args, "perform_rl_step", False) and not getattr(
        args, "no_load_optim", False
    )
    return not getattr(args, "skip_train", False) or rl_optimizer


def _check_expert_grid(args: argparse.Namespace) -> None:
    """Megatron's expert grid (expert TP x EP x PP) must divide the world, as the dense grid
    (TP x CP x PP) does; validate_args checks only the dense one."""
    world = getattr(args, "world_size", None)
    if not getattr(args, "num_experts", None) or not world:
        return
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if world % (etp * ep * pp):
        hint = "e.g. --expert-tensor-parallel-size 1" if etp > 1 else "or launch more processes"
        raise ValueError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} (it "
            f"defaults to --tensor-model-parallel-size) x --pipeline-model-parallel-size {pp} = "
            f"{etp * ep * pp} does not divide the world size {world}: Megatron's expert process "
            f"grid cannot be built (lower one of them, {hint})"
        )


def _check_eval_interval(args: argparse.Namespace) -> None:
    """Megatron 0.19.2 has no default ``--eval-interval`` and divides by it to count evaluation
    samples whenever it trains, even with ``--eval-iters 0``."""
    training = not getattr(args, "skip_train", False)
    full = getattr(args, "full_validation", False)
    if training and not full and getattr(args, "eval_interval", None) is None:
        raise ValueError(
            "--eval-interval is required when training (Megatron 0.19.2 has no default and "
            "divides by it to size the validation samples, even with --eval-iters 0): e.g. "
            "--eval-interval 1000"
        )


def _check_learning_rate(args: argparse.Namespace) -> None:
    """Megatron 0.19.2 has no default ``--lr``; its ``OptimizerParamScheduler`` takes
    ``float(None)`` (a ``TypeError`` on every rank) wherever the optimizer is built."""
    if getattr(args, "lr", None) is None and builds_optimizer(args):
        raise ValueError(
            "--lr is required when training (Megatron 0.19.2 has no default learning rate; its "
            "OptimizerParamScheduler fails on none): e.g. --lr 3e-4 (--skip-train evaluates "
            "without one)"
        )
