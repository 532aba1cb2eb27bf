"""Argument-time checks of Megatron's ``--sft`` under ``megatron_ext.pretrain_gpt`` (glue).

``--sft`` trains on :class:`~megatron_ext.data.sft_dataset.SelfPaddedSFTDataset` (Megatron's
``SFTDataset`` with self pads and whole-conversation packing). What it needs, and the combinations it
cannot run, are refused here in one line, before anything is built::

    --sft --tokenizer-type NullTokenizer  ->  ValueError: --sft needs --tokenizer-type SFTTokenizer ...
"""

import argparse
import importlib.util
import os

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import flag_value

#: What to install for --sft (pyproject's ``sft`` extra; the version requirements/lock.txt pins).
SFT_INSTALL = "pip install 'megatron_ext[sft]' (or: pip install datasets==5.2.0)"


def check_sft_args(args: argparse.Namespace) -> None:
    """Refuses, naming the flags, what ``--sft`` cannot run; a no-op without ``--sft``.

    Raises:
        ValueError: The first refusal.
    """
    view = MegatronView.from_args(args)
    if not view.sft:
        return
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            "--sft reads its JSONL with the `datasets` library (as Megatron's SFTDataset does), "
            f"which is not installed: {SFT_INSTALL}"
        )
    if view.tokenizer_type != "SFTTokenizer":
        raise ValueError(
            "--sft needs --tokenizer-type SFTTokenizer (Megatron's chat-template tokenizer, with "
            f"--tokenizer-model and --sft-tokenizer-prompt-format); got {view.tokenizer_type}"
        )
    refused = (
        (flag_value(args, "pack_documents"), "--pack-documents",
         "--sft packs conversations itself (--sft-packing, --packing-algorithm)"),
        (view.mock_data, "--mock-data", "--sft reads a JSONL of conversations"),
        (flag_value(args, "route_replay_mode") != "off", "--route-replay-mode",
         "route files align with IndexedDataset documents and an SFT JSONL has none"),
    )  # fmt: skip
    for is_set, name, why in refused:
        if is_set:
            raise ValueError(f"--sft cannot be combined with {name}: {why}")
    _check_tokenizer(view)


def _check_tokenizer(view: MegatronView) -> None:
    """Megatron's ``SFTTokenizer`` on a local ``--tokenizer-model``: its prompt format is known and
    its pad token is in the vocabulary (Megatron would fail at the first sample otherwise). A model
    that is not a local directory is left to Megatron's own build to report."""
    model = view.tokenizer_model
    if not model or not os.path.isdir(model):
        return
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer

    fmt = view.sft_tokenizer_prompt_format
    try:
        tokenizer = SFTTokenizer(model, fmt)
    except NotImplementedError as err:
        raise ValueError(
            f"--sft-tokenizer-prompt-format {fmt} is not one Megatron's SFTTokenizer knows"
        ) from err
    pad = tokenizer.pad_id
    if not isinstance(pad, int) or pad < 0:
        raise ValueError(
            f"--sft-tokenizer-prompt-format {fmt}: its pad token is not in the vocabulary of "
            f"--tokenizer-model {model} (pad id {pad!r})"
        )
