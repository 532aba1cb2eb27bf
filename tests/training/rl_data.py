"""Not a test module: RL training data for the policy-loss tests, as ``ingest-rollouts`` lays it
out beside a token file: ``P_loss_mask`` (uint8), ``P_advantages`` and optionally ``P_logprobs``
(float32), each with its ``.sidecar.json`` header naming the tokens' digest.

Documents are the embedded corpus's first ``num_docs`` (byte ids) cut to ``length`` tokens; the
first ``PROMPT`` tokens of each are its prompt (loss mask 0, advantage 0), its completion's
advantage is deterministic: ``+-(1 + (token % 5) / 4)``, the sign alternating per document.
"""

import numpy as np

from megatron_ext.data.indexed_writer import write_documents, write_token_sidecar

PROMPT = 16


def write_sidecar(prefix: str, suffix: str, values: list, dtype, scope: str, tokens: str) -> None:
    """``prefix + suffix`` with its header naming ``tokens``' digest."""
    lengths = np.array([v.size for v in values], dtype=np.int64)
    write_token_sidecar(
        prefix + suffix, values, tokens, lengths, name=suffix.lstrip("_"), scope=scope, dtype=dtype
    )


def write_rl_data(
    prefix: str, num_docs: int = 64, length: int = 100, logprobs: bool = False
) -> list[np.ndarray]:
    """Writes the tokens and their sidecars at ``prefix``; returns the documents."""
    from megatron_ext.training.corpus import corpus_documents

    docs = [d[:length].astype(np.int32) for d in corpus_documents()[:num_docs]]
    write_documents(prefix, docs, dtype=np.int32)
    completion = [np.arange(d.size) >= PROMPT for d in docs]
    masks = [c.astype(np.uint8) for c in completion]
    advantages = [
        np.where(c, (1.0 if i % 2 else -1.0) * (1 + (d % 5) / 4), 0.0).astype(np.float32)
        for i, (d, c) in enumerate(zip(docs, completion, strict=True))
    ]
    write_sidecar(prefix, "_loss_mask", masks, np.uint8, "mask", prefix)
    write_sidecar(prefix, "_advantages", advantages, np.float32, "sequence", prefix)
    if logprobs:
        values = [np.where(c, -2.0, 0.0).astype(np.float32) for c in completion]
        write_sidecar(prefix, "_logprobs", values, np.float32, "completion", prefix)
    return docs
