"""`bench matrix` runs the seed's request count at every point (its success column), and --num-prompts
overrides it."""

from __future__ import annotations

import json

import pytest

from bench.seed_matrix import SEED_MATRIX, num_requests
from headroom.cli import main


@pytest.mark.parametrize(
    "point,want",
    [
        ((1, 4096, 4096), 20),
        ((4, 32, 256), 40),
        ((16, 256, 256), 80),
        ((16, 256, 1024), 80),
        ((16, 32, 256), 16),
        ((16, 32, 1024), 16),
        ((16, 32, 4096), 16),
        ((16, 256, 4096), 16),
        ((64, 256, 256), 128),
        ((64, 256, 1024), 128),
        ((64, 32, 256), 64),
        ((64, 32, 1024), 64),
        ((64, 32, 4096), 64),
        ((64, 256, 4096), 64),
    ],
)
def test_seed_counts_per_point(point, want):
    assert num_requests(point) == want


def test_every_seed_point_has_a_count_and_the_totals_match_the_success_column():
    assert len(SEED_MATRIX) == 30
    by_con = {c: sum(num_requests(p) for p in SEED_MATRIX if p[0] == c) for c in (1, 4, 16, 64)}
    assert by_con == {1: 9 * 20, 4: 9 * 40, 16: 2 * 80 + 4 * 16, 64: 2 * 128 + 4 * 64}


def test_points_outside_the_seed_matrix_get_a_few_requests_per_client():
    assert num_requests((8, 100, 100)) == 20
    assert num_requests((32, 256, 256)) == 64


def run_matrix(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "m.json"
    argv = ["bench", "matrix", "--points", "4,32,64;16,256,256", "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())["points"]


def test_matrix_uses_the_seed_counts_and_num_prompts_overrides(tmp_path):
    default = run_matrix(tmp_path)
    assert [(p["num_prompts"], p["completed"]) for p in default] == [(20, 20), (80, 80)]
    override = run_matrix(tmp_path, "--num-prompts", "5")
    assert [(p["num_prompts"], p["completed"]) for p in override] == [(5, 5), (5, 5)]
