"""Shared builders for the data and replay dataset tests (not a test file): one place for the
tokenizer and the ``GPTDatasetConfig`` keyword arguments Megatron requires, so every dataset test
builds datasets the same way through Megatron's ``BlendedMegatronDatasetBuilder``.

    kw = gpt_config_kwargs([prefix], sequence_length=16)
    train = build_splits(PackedDataset, PackedDatasetConfig(**kw, pad_to_seq_len=True), [10, 0, 0])[0]
"""

from typing import Any

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizer


def null_tokenizer(vocab_size: int = 128, **kwargs: Any) -> MegatronTokenizer:
    """Megatron's null text tokenizer (eod = vocab_size - 1 unless ``eod_id`` is given)."""
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=vocab_size, **kwargs
    )


def gpt_config_kwargs(
    prefixes: list[str],
    *,
    sequence_length: int,
    weights: list[float] | None = None,
    random_seed: int = 1,
    split: str = "100,0,0",
    path_to_cache: str | None = None,
    vocab_size: int = 128,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments of a ``GPTDatasetConfig`` (or a subclass) over ``prefixes``."""
    kwargs: dict[str, Any] = {
        "random_seed": random_seed,
        "sequence_length": sequence_length,
        "blend": (prefixes, weights),
        "split": split,
        "path_to_cache": path_to_cache,
        "tokenizer": null_tokenizer(vocab_size),
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }
    kwargs.update(overrides)
    return kwargs


def build_splits(dataset_cls: type, config: Any, sizes: list[int | None]) -> list:
    """Train/valid/test datasets of ``dataset_cls`` through Megatron's builder."""
    return BlendedMegatronDatasetBuilder(dataset_cls, list(sizes), lambda: True, config).build()


def write_documents_with_random_routes(
    prefix: str, docs: list, rng: Any, *, num_layers: int, topk: int, num_experts: int
) -> str:
    """``prefix.bin/.idx`` (int32 tokens) plus a ``prefix_routes`` sidecar (with its header and the
    tokens' digest) of random valid routes: per token and layer, ``topk`` distinct experts drawn
    from ``rng``."""
    import numpy as np

    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_dataset import write_route_sidecar

    write_documents(prefix, docs, np.int32)
    routes = [
        np.argsort(rng.random((d.size, num_layers, num_experts)), axis=-1)[..., :topk].astype(
            np.uint8
        )
        for d in docs
    ]
    write_route_sidecar(
        prefix + "_routes", routes, num_layers=num_layers, topk=topk, num_experts=num_experts,
        tokens_prefix=prefix,
    )  # fmt: skip
    return prefix


def megatron_pair(prefix, lengths: list[int], docs_of: list[int], dtype: Any = None) -> None:
    """``prefix.bin/.idx`` by Megatron's IndexedDatasetBuilder: ``docs_of[d]`` sequences per
    document, sequence lengths in order, tokens counting up from 1."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype or np.uint16)
    seqs = iter(lengths)
    for count in docs_of:
        lens = [next(seqs) for _ in range(count)]
        builder.add_document(list(range(1, sum(lens) + 1)), lens)
    builder.finalize(str(prefix) + ".idx")


def edit_index(prefix, field: str, values: list[int]) -> None:
    """Overwrites one array of a Megatron .idx in place (the file keeps its size): the layout
    of megatron-core 0.19.2's _IndexReader, a 34-byte header then int32 lengths, int64
    pointers, int64 document indices."""
    import numpy as np

    path = str(prefix) + ".idx"
    with open(path, "rb") as f:
        count = int(
            np.frombuffer(f.read(26)[18:], dtype=np.uint64)[0]
        )  # after magic, version, dtype
    offset, dtype = {"lengths": (34, np.int32), "documents": (34 + 12 * count, np.int64)}[field]
    array = np.memmap(path, dtype=dtype, mode="r+", offset=offset, shape=(len(values),))
    array[:] = values
    array.flush()
    del array
