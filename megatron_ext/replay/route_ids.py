"""Expert ids a caller hands :class:`~megatron_ext.replay.route_replay.RouteReplay`, checked and
narrowed to the route sidecar's dtype (pure numpy, never imports megatron).

The sidecar's dtype marks a missing row with all-max ids; any other integer input with -1::

    narrow_routes(np.array([[[3, 1]], [[-1, -1]]]), 8, np.dtype(np.uint8))
    # -> [[[3, 1]], [[255, 255]]] uint8
"""

import numpy as np

from megatron_ext.replay.routes import missing_value


def narrow_routes(routes: np.ndarray, num_experts: int, dtype: np.dtype) -> np.ndarray:
    """Expert ids in ``dtype`` with its missing marker (an input of another dtype marks a missing
    row with -1 in all K entries). ValueError: a non-integer input, an id outside ``[0, E)``, a
    partly missing row or a repeated id in a row."""
    if not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(f"routes must hold integer expert ids, got {routes.dtype}")
    marker = missing_value(dtype)
    if routes.dtype == dtype:
        missing_XK = routes == marker
    else:
        missing_XK = routes == -1
    missing_X = missing_XK.all(-1)
    if (missing_XK.any(-1) & ~missing_X).any():
        raise ValueError("a route row is partly missing: mark a missing row in all K entries")
    ids = np.where(missing_XK, 0, routes)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"route ids must lie in [0, {num_experts}) (or mark a missing row)")
    ordered = np.sort(ids, axis=-1)
    if ((ordered[..., 1:] == ordered[..., :-1]).any(-1) & ~missing_X).any():
        raise ValueError("a route row repeats an expert: top-k ids must be distinct")
    out = ids.astype(dtype)
    out[missing_X] = marker
    return out
