"""Tests for the benchmark helpers: the matmul inventory of `benchmarks.step_floor`
(hand-counted FLOPs) and one tiny end-to-end run of the floor benchmark."""

import json

from benchmarks import step_floor
from jaxrl_llm.models import ModelConfig

TINY = ModelConfig(
    vocab_size=5, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, ffn_dim=8
)


def _flops(mm):
    return sum(2 * m * k * n * count for (m, k, n, _), count in mm.items())


def test_step_matmuls_hand_counted_flops():
    # Per row and layer, multiply-adds: q 4x4, k 4x2, v 4x2, o 4x4, gate 4x8, up 4x8,
    # down 8x4 = 144 -> 288 FLOPs; unembedding 4x5 -> 40 FLOPs per row.
    # sample (N=2, Lp=3, T=2): prefill 6 rows + 1 decode step of 2 rows = 8 rows x 288,
    #   plus the unembedding of N x T = 4 last positions x 40 -> 2304 + 160 = 2464.
    # update: N x (Lp + T) = 10 rows, forward 10 x (288 + 40) = 3280, x 3 with backward.
    mm = step_floor.step_matmuls(TINY, 2, 3, 2)
    assert _flops(mm) == 2464 + 3 * 3280
    fused = step_floor.step_matmuls(TINY, 2, 3, 2, fused_update=True)
    assert _flops(fused) == _flops(mm)
    assert sum(fused.values()) < sum(mm.values())  # fewer, wider matmuls
    # dW = x^T dy contracts over the update's rows.
    assert (TINY.d_model, 10, TINY.ffn_dim, True) in mm


def test_step_floor_runs_and_prints_one_json_line(capsys):
    step_floor.main(
        "--d-model 16 --layers 1 --heads 2 --kv-heads 1 --ffn 32 --vocab 8 "
        "--prompts 2 --group 2 --prompt-len 2 --new-tokens 2 --host-devices 1".split()
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    rec = json.loads(out[0])
    assert rec["benchmark"] == "step_floor"
    assert 0 < rec["sample_floor_s"] < rec["floor_s"]
    update = min(rec["update_floor_s"], rec["update_fused_floor_s"])
    assert abs(rec["floor_s"] - update - rec["sample_floor_s"]) <= 1e-3 * rec["floor_s"]
