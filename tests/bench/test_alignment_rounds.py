"""Tier: pure. How many rounds the alignment benchmark runs per token count.

The few-token rows (the ones a shared machine's noise moves most, a trip being a fraction of a
millisecond) run whole Williams designs in the full run; the largest keep the run's rounds; the
quick run (CI) keeps its few.
"""

from megatron_ext.bench import alignment as b
from megatron_ext.bench.rounds import design_length


def test_few_token_rows_run_whole_designs_and_the_largest_keep_the_rounds():
    assert b._rounds_for(48, 15, 15, 2) == 2 * design_length(15) == 60  # odd count: 2n per design
    assert b._rounds_for(b.FEW_TOKENS, 15, 8, 2) == 16  # even count: n per design
    assert b._rounds_for(b.FEW_TOKENS + 1, 15, 15, 2) == 15
    assert b._rounds_for(48, 15, 2, 2) == 15  # a design shorter than the rounds: never fewer
    assert b._rounds_for(48, 5, 15, 0) == 5  # quick: no designs asked

