"""Tier: pure (json + numpy). megatron_ext.data.sidecar_header: a per-token sidecar's header round
trip and the tokens-digest check (the same digest as the route header's)."""

import numpy as np
import pytest

from megatron_ext.data.sidecar_header import (
    check_tokens_digest,
    read_sidecar_header,
    sidecar_header_bytes,
)


def _tokens(prefix, data: bytes) -> None:
    for ext, content in ((".idx", b"index"), (".bin", data)):
        with open(prefix + ext, "wb") as f:
            f.write(content)


def test_header_round_trip_and_tokens_digest(tmp_path):
    from megatron_ext.replay.route_file import tokens_digest

    tokens = str(tmp_path / "rl")
    _tokens(tokens, b"0123")
    header = sidecar_header_bytes(
        name="advantages", key="advantage", scope="sequence", dtype=np.float32,
        lengths_D=np.array([3, 4]), tokens_digest=tokens_digest(tokens),
    )  # fmt: skip
    (tmp_path / "rl_advantages.sidecar.json").write_bytes(header)
    got = check_tokens_digest(str(tmp_path / "rl_advantages"), tokens)
    assert (got["num_documents"], got["num_tokens"], got["dtype"]) == (2, 7, "float32")
    assert got["name"] == "advantages" and got["key"] == "advantage"
    _tokens(tokens, b"0124")  # the same lengths, another token
    with pytest.raises(ValueError, match=r"rl_advantages was written for other token data"):
        check_tokens_digest(str(tmp_path / "rl_advantages"), tokens)
    with pytest.raises(ValueError, match=r"sidecar .*rl_x has no header"):
        check_tokens_digest(str(tmp_path / "rl_x"), tokens)


def test_malformed_headers_are_refused(tmp_path):
    path = tmp_path / "h.sidecar.json"
    for text, match in (("{", "not valid JSON"), ('{"format": "x"}', "not a megatron_ext"),
                        ('{"format": "megatron_ext.token_sidecar", "version": 2}', "version 2")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_sidecar_header(str(path))
