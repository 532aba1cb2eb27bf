"""Tier: one gloo rank (Megatron's real dispatchers, EP=1).

The alignment benchmark's 'unaligned copy/unaligned' column times a second, identical unaligned
layer as one more variant: the ratio identical code gets on the machine, to read the others
against. The copy must really compute what the unaligned layer computes; the check that says so
must refuse a layer that does not (other outputs, or other groups).
"""

import torch

from megatron_ext.testing import run_distributed


def _copy_checks() -> dict:
    from megatron_ext.bench import alignment_rows as b
    from megatron_ext.bench.dispatcher_variant import DISPATCHERS, build_layer

    out = {}
    for dispatcher in DISPATCHERS:
        stock, copy = build_layer(dispatcher, 64, False), build_layer(dispatcher, 64, False)
        x = torch.randn(48, 1, 64)
        with torch.no_grad():
            probs, routing_map = stock.route(x)
        b._check_same_layer(stock, copy, x, probs, routing_map)  # the same computation: passes
        d = copy.token_dispatcher
        post, combine = d.dispatch_postprocess, d.combine_postprocess

        def other_groups(h, p, post=post):
            h, tokens_per_expert, p = post(h, p)
            return h, tokens_per_expert.roll(1), p

        def other_output(h, combine=combine):
            return combine(h) + 1

        for name, method, broken in (
            ("groups", "dispatch_postprocess", other_groups),
            ("output", "combine_postprocess", other_output),
        ):
            setattr(d, method, broken)
            try:
                b._check_same_layer(stock, copy, x, probs, routing_map)
                out[dispatcher, name] = "accepted"
            except AssertionError:
                out[dispatcher, name] = "refused"
            finally:
                delattr(d, method)  # the class's method again
    return out


def test_the_copy_computes_the_same_and_a_different_computation_is_refused():
    results = run_distributed(_copy_checks, 1, ep=1, timeout=120)[0]
    assert set(results.values()) == {"refused"} and len(results) == 4, results
