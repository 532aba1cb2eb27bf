"""Argument-time checks of what Megatron 0.19.2 accepts in ``validate_args`` but fails on later.

Each check names the flags and says what to set; without it the run fails after startup (the
expert process grid, in ``initialize_model_parallel``) or after the model is built (the sample
counts, in ``get_train_valid_test_num_samples``), on every rank, with a traceback.
"""

import argparse

from megatron_ext.config.megatron_view import MegatronView


def check_launch_args(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the flags of the first combination Megatron would fail on."""
    from megatron_ext.training.gpt_builder import check_gpt_builder

    view = MegatronView.from_args(args)
    check_gpt_builder(view)  # megatron-core 0.18.2's GPT models: what megatron_ext builds
    _check_expert_grid(view)
    _check_eval_interval(view)
    _check_learning_rate(view)


def builds_optimizer(args: argparse.Namespace | MegatronView) -> bool:
    """Whether Megatron's ``setup_model_and_optimizer`` builds the optimizer and its LR scheduler:
    not under ``--skip-train`` (evaluation only), unless an RL step loads the optimizer.

    Args:
        args: Megatron's arguments, or their view.
    """
    view = args if isinstance(args, MegatronView) else MegatronView.from_args(args)
    rl_optimizer = view.perform_rl_step and not view.no_load_optim
    return not view.skip_train or rl_optimizer


def _check_expert_grid(view: MegatronView) -> None:
    """Megatron's expert grid (expert TP x EP x PP) must divide the world, as the dense grid
    (TP x CP x PP) does; validate_args checks only the dense one."""
    world = view.world_size
    if not view.num_experts or not world:
        return
    tp = view.tensor_model_parallel_size or 1
    etp = view.expert_tensor_parallel_size or tp
    ep = view.expert_model_parallel_size or 1
    pp = view.pipeline_model_parallel_size or 1
    if world % (etp * ep * pp):
        hint = "e.g. --expert-tensor-parallel-size 1" if etp > 1 else "or launch more processes"
        raise ValueError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} (it "
            f"defaults to --tensor-model-parallel-size) x --pipeline-model-parallel-size {pp} = "
            f"{etp * ep * pp} does not divide the world size {world}: Megatron's expert process "
            f"grid cannot be built (lower one of them, {hint})"
        )


def _check_eval_interval(view: MegatronView) -> None:
    """Megatron 0.19.2 has no default ``--eval-interval`` and divides by it to count evaluation
    samples whenever it trains, even with ``--eval-iters 0``."""
    if not view.skip_train and not view.full_validation and view.eval_interval is None:
        raise ValueError(
            "--eval-interval is required when training (Megatron 0.19.2 has no default and "
            "divides by it to size the validation samples, even with --eval-iters 0): e.g. "
            "--eval-interval 1000"
        )


def _check_learning_rate(view: MegatronView) -> None:
    """Megatron 0.19.2 has no default ``--lr``; its ``OptimizerParamScheduler`` takes
    ``float(None)`` (a ``TypeError`` on every rank) wherever the optimizer is built."""
    if view.lr is None and builds_optimizer(view):
        raise ValueError(
            "--lr is required when training (Megatron 0.19.2 has no default learning rate; its "
            "OptimizerParamScheduler fails on none): e.g. --lr 3e-4 (--skip-train evaluates "
            "without one)"
        )
