"""The header of a per-token sidecar: what its values are and which token data they belong to
(pure json + numpy, never imports megatron).

A sidecar ``P_S.bin/.idx`` holds one value per token of ``P``; its ``.idx`` says how many values
each document has, not what they mean nor which token file they were made for. ``P_S.sidecar.json``
does, so a sidecar beside rewritten tokens is refused (:func:`check_tokens_digest`) even at the
same lengths::

    {"format": "megatron_ext.token_sidecar", "version": 1, "name": "advantages",
     "key": "advantages", "scope": "completion", "dtype": "float32", "num_documents": 4,
     "num_tokens": 40, "tokens_digest": "bac259f1..."}
"""

import json
import os

import numpy as np

#: Extension of the header beside ``P_S.bin`` / ``P_S.idx``.
SIDECAR_EXTENSION = ".sidecar.json"
FORMAT = "megatron_ext.token_sidecar"
VERSION = 1
# completion: a value per completion token (prompt tokens hold 0); sequence: one per-sequence
# value broadcast to the completion's tokens; mask: the loss mask (completion tokens 1); token: a
# value per token (--rl-record-logprobs' log-probs, a document's first token 0).
SCOPES = ("completion", "sequence", "mask", "token")


def sidecar_header_bytes(
    *,
    name: str,
    key: str | None,
    scope: str,
    dtype: np.dtype,
    lengths_D: np.ndarray,
    tokens_digest: str,
) -> bytes:
    """The header of a sidecar whose document d holds ``lengths_D[d]`` values.

    ``tokens_digest``: ``route_file.tokens_digest`` of the token ``.idx``/``.bin`` (the route
    header records the same).
    """
    assert scope in SCOPES, scope
    header = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "key": key,
        "scope": scope,
        "dtype": np.dtype(dtype).name,
        "num_documents": int(np.asarray(lengths_D).size),
        "num_tokens": int(np.sum(lengths_D, dtype=np.int64)),
        "tokens_digest": tokens_digest,
    }
    return (json.dumps(header, indent=1) + "\n").encode("utf-8")


def read_sidecar_header(path: str) -> dict:
    """Reads a sidecar header; ValueError naming the file for one not JSON, of another format
    or version, or with a malformed field."""
    try:
        with open(path, encoding="utf-8") as f:
            header = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"sidecar header {path} is not valid JSON ({err})") from err
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"sidecar header {path} is not a {FORMAT} header")
    if header.get("version") != VERSION:
        raise ValueError(
            f"sidecar header {path} has version {header.get('version')}, not {VERSION}"
        )
    for key in ("num_documents", "num_tokens"):
        # type() is not int: a JSON true would pass isinstance(..., int).
        if type(header.get(key)) is not int or header[key] < 0:
            raise ValueError(f"sidecar header {path}: {key!r} must be a non-negative integer")
    if header.get("scope") not in SCOPES or not isinstance(header.get("tokens_digest"), str):
        raise ValueError(f"sidecar header {path}: needs a scope in {SCOPES} and a tokens_digest")
    return header


def check_tokens_digest(sidecar_prefix: str, tokens_prefix: str, digest: str | None = None) -> dict:
    """The sidecar's header, refused (ValueError naming both prefixes) when missing or naming
    other token data than ``tokens_prefix``'s content (``digest``: that content's, if known)."""
    from megatron_ext.common.safe_files import content_digest

    path = sidecar_prefix + SIDECAR_EXTENSION
    if not os.path.isfile(path):
        raise ValueError(f"sidecar {sidecar_prefix} has no header {path}: its tokens are unknown")
    header = read_sidecar_header(path)
    if digest is None:
        digest = content_digest([tokens_prefix + ".idx", tokens_prefix + ".bin"])
    if header["tokens_digest"] != digest:
        raise ValueError(
            f"sidecar {sidecar_prefix} was written for other token data than {tokens_prefix} "
            "(its tokens_digest differs): write the tokens and their sidecars together again "
            "(megatron-ext ingest-rollouts)"
        )
    return header
