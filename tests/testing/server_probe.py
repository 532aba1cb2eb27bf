"""A rank for tests/rehearse/test_rank_server.py: ``python -m tests.testing.server_probe``, forked from
the preloaded server, prints one ``PROBE {json}`` line about what the server computed once for every
rank (:func:`megatron_ext.rehearse.rank_server.compute_once_for_every_rank`)."""

import json

from megatron.training import argument_utils

from megatron_ext import compat
from megatron_ext.compat import host_torch

factory = argument_utils.ArgumentGroupFactory
method = factory._get_field_docstrings
memo = getattr(method, "memo", {})
instance = object.__new__(factory)
# Megatron's own method, unmemoized, against each call through the memo; a caller's change to the
# dict it got must not reach the next caller.
same = [method(instance, cls) == method.__wrapped__(instance, cls) for cls in memo]
first = next(iter(memo), None)
if first is not None:
    method(instance, first).clear()
print("PROBE " + json.dumps({
    "classes": len(memo),
    "fields": sum(len(found) for found in memo.values()),
    "same": all(same),
    "copies": first is None or method(instance, first) == method.__wrapped__(instance, first),
    "renamed": len(host_torch._RENAMED),
    "applied": [row.name for row in compat.rows("cpu", "cpu_loop", "validate_on_target")
                if compat.applied(row)],
}), flush=True)  # fmt: skip
