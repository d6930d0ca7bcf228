"""The proved lower bound of bench/kv_phase_bound.py never exceeds what a schedule achieves: the exact
optimum of small instances (exhaustive search) and every rule the script simulates at the real point."""

from __future__ import annotations

from bench import kv_phase_bound as kv


def test_bound_below_exact_optimum_of_small_instances():
    for clients, pool, block, rounds in kv.SMALL[:2]:
        blocks = kv.blocks_held(block, 4 * block, block)
        bound = kv.lower_bound(clients, rounds, blocks, pool)
        assert rounds * len(blocks) < bound <= kv.exact_steps(clients, rounds, blocks, pool)


def test_bound_below_every_simulated_rule_at_the_point():
    bound = kv.lower_bound(kv.CLIENTS, kv.ROUNDS, kv.BLOCKS, kv.POOL)
    assert bound > kv.ROUNDS * kv.OUTPUT
    for weights in kv.FAMILIES.values():
        assert bound <= kv.steps_with(weights)[0]


def test_fewest_waits_drops_the_biggest_first():
    assert kv.fewest_waits([5] * 16, 64) == 4
    assert kv.fewest_waits([5] * 12 + [2] * 4, 64) == 1  # 68 blocks: one 5 out
    assert kv.fewest_waits([4] * 16, 64) == 0
