"""Tier: gloo ranks (EP=2; providers and forward step on arguments parsed and validated by Megatron).

The entry path's default dataset (``SelfPaddedGPTDataset``, no ``--pack-documents``) hands the pad
mask to the model, and it takes effect: Megatron's router aux loss and megatron_ext's load metric
leave the pads out. The pads here are Megatron's own batch-padding sample (``dataset[None]``, all
pads), next to a real sample.

- Aux loss (Megatron's ``load_balancing_loss``, per layer, this rank): the batch [real, pads] gives
  the aux loss of the real sample alone, and the same batch with the pad mask dropped does not.
- Load metric: real tokens = K x the real sample's positions; under ``--moe-pad-routing auto`` (skip
  here) the pad row reaches no expert, so the tokens counted with pads are the same.
"""

import sys

import pytest
import torch

from megatron_ext.testing import run_distributed
from tests.training.entry_args import BASE_ARGS, TOPK

#: Aux loss on, load metrics on; everything else the pretraining default (self-padded GPTDataset).
ARGS = BASE_ARGS + ["--moe-aux-loss-coeff", "0.01", "--moe-expert-load-metrics"]


def _aux_loss_and_load(argv: list[str]) -> dict:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.training import run_state
    from megatron_ext.training.arguments import add_megatron_ext_args
    from megatron_ext.training.dataset_provider import train_valid_test_datasets_provider
    from megatron_ext.training.forward_step import forward_step, model_inputs
    from megatron_ext.training.model_provider import model_provider

    unset_global_variables()
    run_state.reset()
    sys.argv = ["pretrain_gpt", *argv]
    args = parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    args.curr_iteration = 0
    model = model_provider()
    train, _, _ = train_valid_test_datasets_provider([8, 0, 0])
    tracker = get_moe_metrics_tracker()

    def aux_loss_L(batch: dict, *, drop_padding_mask: bool = False) -> torch.Tensor:
        tracker.metrics.clear()
        if drop_padding_mask:
            kwargs = model_inputs(batch, args)
            kwargs.pop("padding_mask")
            model(**kwargs, loss_mask=batch["loss_mask"]).sum().backward()
        else:
            output, loss_fn = forward_step(iter([batch]), model)
            loss_fn(output)[0].backward()
        return tracker.metrics["load_balancing_loss"].values.clone()

    rank = torch.distributed.get_rank()
    real = train[3 + rank]  # not sample 0: the padding sample's content is sample 0's tokens
    pads = train[None]
    with_pads = torch.utils.data.default_collate([real, pads])
    metrics = run_state.load_metrics(args)
    ours = aux_loss_L(with_pads)  # the entry path: forward_step -> model_inputs -> GPTModel
    summary = metrics.summary(torch.distributed.group.WORLD)
    metrics.reset()
    alone = aux_loss_L(torch.utils.data.default_collate([real]))
    dropped = aux_loss_L(with_pads, drop_padding_mask=True)
    return {
        "dataset": type(train).__name__,
        "pads": int(with_pads["padding_mask"].sum()),
        "real_pads": int(real["padding_mask"].sum()),
        "positions": with_pads["tokens"].numel(),
        "ours": ours,
        "alone": alone,
        "dropped": dropped,
        "tokens": [sum(summary[f"layer{n}/tokens"]) for n in (1, 2)],
        "real": [sum(summary[f"layer{n}/real_tokens"]) for n in (1, 2)],
    }


@pytest.fixture(scope="module")
def results(data_prefix):
    return run_distributed(_aux_loss_and_load, 2, ARGS + ["--data-path", data_prefix], ep=2)


def test_aux_loss_leaves_the_padding_sample_out(results) -> None:
    for r in results:
        assert r["dataset"] == "SelfPaddedGPTDataset"
        assert r["pads"] == r["positions"] // 2 and r["real_pads"] == 0  # one real row, one pad row
        assert (r["alone"] > 0).all()
        # Not bitwise: the fp32 GEMMs round a row differently with 1 or 2 rows in the batch
        # (measured: at most 1 ulp, 1.2e-7 at an aux loss of ~1.05).
        torch.testing.assert_close(r["ours"], r["alone"], rtol=1e-6, atol=0)
        # Dropping the mask lets the pads in: measured 6e-4 to 3e-3 relative per layer, so the
        # check has 100x margin over the tolerance above.
        assert ((r["dropped"] - r["alone"]).abs() / r["alone"]).max() > 1e-4


def test_load_metric_counts_real_tokens_apart(results) -> None:
    ranks = len(results)
    positions = results[0]["positions"]
    for r in results:
        # Summed over both ranks. --moe-pad-routing auto skips pads here (dropless), so the pad
        # row reaches no expert: the tokens counted with pads are the real ones.
        assert r["real"] == [TOPK * positions // 2 * ranks] * 2
        assert r["tokens"] == r["real"]
