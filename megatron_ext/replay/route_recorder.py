"""Record mode's recorder: routes recorded per pack, streamed to disk, written as a route sidecar
(Megatron glue over :mod:`~megatron_ext.replay.route_stream`).

Example::

    recorder = RouteRecorder.for_dataset(dataset)              # a RoutedPackedDataset
    recorder.add_pack(dataset.pack_pieces(i), routes_SLK)      # per recorded pack, as it comes
    recorder.write("/data/rl_routes")                          # .bin/.idx/.routes.json
    recorder.close()

Legend: S positions of a pack, L MoE layers, K top-k.
"""

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.common.safe_files import file_identity
from megatron_ext.replay.route_stream import RouteStream, assemble_route_sidecar, remove_stream
from megatron_ext.replay.routes import route_dtype


class RouteRecorder(RouteStream):
    """Streams routes recorded per pack to disk and writes them as a route sidecar.

    A :class:`~megatron_ext.replay.route_stream.RouteStream` that knows its documents. Tokens
    never recorded (documents no pack reached, dropped tails, pads) stay missing.

    Args:
        doc_lengths: Token count of every document of the token dataset (may be memory-mapped).
        num_layers, topk, num_experts: L, K, E.
        stream: Path prefix of this recorder's stream (``.pieces``/``.rows``); None: in a
            temporary directory, removed by :meth:`close`.
        doc_offsets, offset_unit: As ``assemble_route_sidecar``'s ``doc_offsets_D``.
        tokens_prefix, moe_layer_ids: For the header (the recording's token data and MoE
            layers); None: not recorded.
    """

    def __init__(
        self,
        doc_lengths: np.ndarray,
        num_layers: int,
        topk: int,
        num_experts: int,
        *,
        stream: str | None = None,
        doc_offsets: np.ndarray | None = None,
        offset_unit: int = 1,
        tokens_prefix: str | None = None,
        moe_layer_ids: Sequence[int] | None = None,
    ):
        route_dtype(num_experts, topk)  # refuses E / K before a temporary directory exists
        self.docs_shape = (num_layers, topk)
        self.num_experts = num_experts
        self.doc_lengths, self.doc_offsets, self.offset_unit = doc_lengths, doc_offsets, offset_unit
        self.tokens_prefix = tokens_prefix
        if moe_layer_ids is not None and len(moe_layer_ids) != num_layers:
            raise ValueError(
                f"{len(moe_layer_ids)} MoE layer ids {list(moe_layer_ids)} for {num_layers} "
                "recorded layers"
            )
        self.moe_layer_ids = None if moe_layer_ids is None else [int(i) for i in moe_layer_ids]
        # The token files' state when recording starts: the header's digest must describe the
        # tokens the routes were recorded on, so a rewrite before write() is refused there.
        self._tokens_state = None if tokens_prefix is None else _files_state(tokens_prefix)
        self._tmpdir = tempfile.mkdtemp(prefix="megatron_ext_routes_") if stream is None else None
        base = stream if stream is not None else os.path.join(self._tmpdir, "stream")
        super().__init__(base, num_layers, topk, num_experts)

    @classmethod
    def for_dataset(
        cls,
        dataset: Any,
        stream: str | None = None,
        moe_layer_ids: Sequence[int] | None = None,
    ) -> "RouteRecorder":
        """A recorder sized for the documents under ``dataset`` (a ``RoutedPackedDataset``;
        lengths and offsets are read from its token index, memory-mapped); ``moe_layer_ids`` as
        in the constructor."""
        cfg = dataset.config
        tokens = dataset.dataset.tokens
        offsets, unit = _token_offsets(tokens)
        return cls(
            tokens.sequence_lengths,
            cfg.route_num_layers,
            cfg.route_topk,
            cfg.route_num_experts,
            stream=stream,
            doc_offsets=offsets,
            offset_unit=unit,
            tokens_prefix=tokens.path_prefix,
            moe_layer_ids=moe_layer_ids,
        )

    def write(
        self, path_prefix: str, overwrite: bool = False, streams: list[str] | None = None
    ) -> int:
        """Writes ``path_prefix.bin/.idx`` and its header atomically; returns the number of
        documents. ``streams``: the stream bases to assemble, later ones winning (None: this
        recorder's own, flushed and closed first). ValueError for an existing output (without
        ``overwrite``) or token data rewritten since recording started."""
        super().close()  # flushed, not removed
        if (
            self.tokens_prefix is not None
            and _files_state(self.tokens_prefix) != self._tokens_state
        ):
            raise ValueError(
                f"the token data {self.tokens_prefix} was rewritten while its routes were being "
                "recorded: the recording belongs to neither version of it; record again"
            )
        return assemble_route_sidecar(
            path_prefix,
            [self.base] if streams is None else streams,
            doc_lengths_D=self.doc_lengths,
            doc_offsets_D=self.doc_offsets,
            offset_unit=self.offset_unit,
            num_layers=self.docs_shape[0],
            topk=self.docs_shape[1],
            num_experts=self.num_experts,
            overwrite=overwrite,
            tokens_prefix=self.tokens_prefix,
            moe_layer_ids=self.moe_layer_ids,
        )

    def close(self) -> None:
        """Closes the stream and removes it if it is temporary."""
        super().close()
        if self._tmpdir is not None:
            remove_stream(self.base)
            os.rmdir(self._tmpdir)
            self._tmpdir = None

    def __del__(self) -> None:
        if getattr(self, "_tmpdir", None) is not None:
            self.close()


def _token_offsets(tokens: IndexedDataset) -> tuple[np.ndarray | None, int]:
    """The token index's byte pointers and dtype size when documents lie back to back (as every
    writer lays them out; checked in chunks), else ``(None, 1)``: offsets from the lengths."""
    index = tokens.index
    lengths, pointers, unit = index.sequence_lengths, index.sequence_pointers, index.dtype_size
    chunk, carry = 1 << 20, 0
    for lo in range(0, lengths.size, chunk):
        ends = np.cumsum(lengths[lo : lo + chunk], dtype=np.int64) * unit + carry
        if not np.array_equal(ends[:-1], pointers[lo + 1 : lo + chunk]) or pointers[lo] != carry:
            return None, 1
        carry = int(ends[-1])
    return pointers, unit


def record_streams(path_prefix: str) -> tuple[int | None, bool, list[str]]:
    """Who records where in a run: ``(this rank's data-parallel rank, or None off the data-parallel
    group of global rank 0; whether this rank writes the sidecar; the stream base of each DP rank
    of that group, in DP rank order)``. Streams sit beside the output: ``<path_prefix>.dp<r>``.
    """
    # The other data-parallel groups record the same routes (every rank of a model-parallel
    # group holds the whole micro-batch's routes after recorded_routes): they stream nothing.
    import torch
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        return 0, True, [f"{path_prefix}.dp0"]
    ranks = torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group())
    streams = [f"{path_prefix}.dp{r}" for r in range(len(ranks))]
    me = torch.distributed.get_rank()
    return (ranks.index(me) if 0 in ranks else None), me == 0, streams


def _files_state(tokens_prefix: str) -> tuple[str, str]:
    """The identities (inode, size, mtime, ctime) of a token prefix's ``.idx`` and ``.bin``."""
    return file_identity(tokens_prefix + ".idx"), file_identity(tokens_prefix + ".bin")
