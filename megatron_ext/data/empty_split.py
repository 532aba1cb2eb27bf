"""The error for samples asked of a split that holds no tokens (glue over Megatron's split math).

Megatron's builder rounds each split's share of a prefix's documents, so a non-zero ``--split``
weight can leave a split without documents, and ``GPTDataset`` then never finishes building (its
``_get_num_epochs`` adds epochs of zero tokens; it wants one extra label token even when no sample
is asked). Only the datasets know the data, so they refuse it, naming prefix, split and flag::

    --data-path /d/tiny (10 documents) with --split 99,1,0: the valid split gets no documents
    (its share rounds to 0 of 10), yet 40 samples are asked of it (--eval-iters evaluates on the
    validation split): set --eval-iters 0, or give the split documents (a larger --split weight
    or more data)
"""

from typing import Any

from megatron.core.datasets.utils import Split

#: The flags whose value makes Megatron's training loop ask samples of each split.
_ASKED_BY = {
    Split.train: "--train-iters / --train-samples ask for them",
    Split.valid: "--eval-iters evaluates on the validation split",
    Split.test: "--eval-iters also sets the test iterations",
}
#: The remedy every message ends with.
_GIVE_DOCUMENTS = "give the split documents (a larger --split weight or more data)"


def empty_split_error(
    dataset_path: str | None,
    index_split: Split,
    num_samples: int,
    num_documents: int,
    config: Any,
    *,
    documents_in_split: int = 0,
) -> ValueError:
    """The ValueError for ``num_samples`` asked of a split without a single token.

    ``num_documents``: the whole prefix's; ``documents_in_split``: the split's (all empty).
    """
    name = index_split.name
    # Only --data-path's split can empty a split: a per-split file without a token is an empty
    # .bin, which opening refuses already.
    source = f"--data-path {dataset_path} ({num_documents} documents) with --split {config.split}"
    if documents_in_split:
        plural = "s hold" if documents_in_split > 1 else " holds"
        held = f"the {name} split's {documents_in_split} document{plural} no tokens"
    else:
        held = f"the {name} split gets no documents (its share rounds to 0 of {num_documents})"
    fix = (
        _GIVE_DOCUMENTS
        if index_split == Split.train
        else f"set --eval-iters 0, or {_GIVE_DOCUMENTS}"
    )
    return ValueError(
        f"{source}: {held}, yet {num_samples} samples are asked of it "
        f"({_ASKED_BY[index_split]}): {fix}"
    )


def full_validation_error(
    split: str | None, data_path: list[str] | None, data_args_path: str | None = None
) -> ValueError:
    """The ValueError for ``--full-validation`` over a validation split without a sample."""
    # Megatron asks no sample count of the split then (it evaluates all of it), so the datasets
    # build it empty, and its loop would fail on len(None) while building the iterators.
    # --split cuts --data-path or the blend of --data-args-path: name the one given.
    data = (
        f"--data-path {' '.join(data_path)}" if data_path else f"--data-args-path {data_args_path}"
    )
    return ValueError(
        f"--full-validation evaluates on the whole validation split, but --split {split} gives "
        f"it no sample of {data} (its share of the documents rounds to none): drop "
        f"--full-validation, or {_GIVE_DOCUMENTS}"
    )
