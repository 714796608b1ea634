"""Tests for the benchmark helpers: the matmul inventory of `benchmarks.step_floor`
(hand-counted FLOPs), one tiny end-to-end run of the floor benchmark, and the scaling
benchmark's HLO collective count and a tiny two-mesh run."""

import json

from benchmarks import scaling, step_floor
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


# Collectives: all-gather 16 x 4 = 64; all-reduce async pair, counted once at the done:
# bf16 4 x 4 = 32; all-to-all tuple 2 x 4 + 3 x 4 = 20; collective-permute pair 8 x 4 =
# 32; reduce-scatter pred[6] = 6; a fusion's all-gather 2 x 4 = 8; the loop body's
# all-reduce (8 x 4 = 32) x (5 trips (known) + 2 (inferred: from 5, where %w stops, while
# i < 7) + 1 (%w3: no induction variable, a static count)) = 256. The add is no
# collective. Total 418, one static loop.
HLO = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%cmp (a: s32[], b: s32[]) -> pred[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%cond7 (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(7)
  ROOT %lt = pred[] fusion(%i, %c), kind=kLoop, calls=%cmp
}

%fused (x: f32[1]) -> f32[2] {
  %x = f32[1]{0} parameter(0)
  ROOT %g = f32[2]{0} all-gather(%x), dimensions={0}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%c0, %x)
  %ag = f32[16]{0} all-gather(%x), replica_groups={{0,1}}, dimensions={0}
  %ars = bf16[4,4]{1,0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add
  %ard = bf16[4,4]{1,0} all-reduce-done(%ars)
  %a2a = (f32[2]{0}, /*index=1*/s32[3]{0}) all-to-all(%u, %v), replica_groups={{0,1}}
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=1
  %cpd = f32[8]{0} collective-permute-done(%cps)
  %rs = pred[6]{0} reduce-scatter(%m), dimensions={0}, to_apply=%add
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_induction_variable":{"tuple_index":"0"}, \
"known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"5"}}
  %i5 = s32[] get-tuple-element(%w), index=0
  %y = f32[8]{0} get-tuple-element(%w), index=1
  %init2 = (s32[], f32[8]{0}) tuple(%i5, %y)
  %w2 = (s32[], f32[8]{0}) while(%init2), condition=%cond7, body=%body, \
backend_config={"known_induction_variable":{"tuple_index":"0"}}
  %w3 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %f = f32[2]{0} fusion(%z), kind=kLoop, calls=%fused
  ROOT %sum = f32[1000]{0} add(%x, %x)
}
"""


def test_hlo_collective_bytes_hand_counted():
    assert (
        scaling.shape_bytes("(f32[2,3]{1,0}, /*index=1*/bf16[4]{0}, pred[], u32[])")
        == 24 + 8 + 1 + 4
    )
    assert scaling.hlo_collective_bytes(HLO) == (418, 1)
    assert scaling.hlo_collective_bytes(HLO.replace("all-gather", "copy")) == (418 - 72, 1)


def test_scaling_runs_one_and_two_device_meshes(capsys):
    scaling.main(
        "--d-model 16 --layers 1 --heads 2 --kv-heads 1 --ffn 32 --vocab 8 --prompts 4 "
        "--group 2 --prompt-len 3 --new-tokens 3 --steps 1 --warmup 0 "
        "--meshes 1:data=1 2:fsdp=2".split()
    )
    one, two = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert (one["devices"], two["devices"]) == (1, 2)
    assert two["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert one["state_bytes_total"] == two["state_bytes_total"] > 0
    assert one["state_bytes_per_device"] == one["state_bytes_total"]
    # fsdp splits every weight's embed dim (16 / 2): half, plus replicated scalars.
    assert two["state_bytes_per_device"] <= 0.55 * two["state_bytes_total"]
    assert one["collective_bytes_per_step"] == {"update": 0, "sample": 0, "total": 0}
    assert two["collective_bytes_per_step"]["update"] > 0
    assert two["collective_static_loops"] == 0
    assert one["step_s"] > 0 and one["rows"] == two["rows"] == 8


def test_memory_benchmark_lora_state_is_a_fraction_of_full(capsys):
    from benchmarks import memory

    memory.main(
        "--layers 1 --vocab 256 --prompts 1 --group 2 --prompt-len 4 --new-tokens 4 "
        "--lora-rank 2 --variants full_bf16,lora_bf16".split()
    )
    full, lora = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert (full["variant"], lora["variant"]) == ("full_bf16", "lora_bf16")
    # Full fine-tuning: bf16 params + two bf16 AdamW moments = 3 x 2 bytes per parameter.
    assert full["state_bytes"] >= 6 * full["params"]
    # LoRA: only the float32 adapters and their moments are state; the base is frozen bf16.
    assert lora["state_bytes"] < 12 * lora["trained_params"] + 64
    assert lora["trained_params"] < full["params"] / 10
    assert lora["frozen_bytes"] == 2 * full["params"]
    for rec in (full, lora):
        assert rec["update_peak_bytes"] > 0 and rec["sample_peak_bytes"] > 0


def test_rollout_benchmark_rl_steps_with_and_without_partial_rollouts(capsys):
    from benchmarks import rollout

    rollout.main(
        "--d-model 16 --ffn 32 --layers 1 --heads 2 --kv-heads 1 --vocab 32 --rollouts 16 "
        "--slots 8 --group-size 4 --extra-groups 2 --rl-steps 2 --mean-len 3 "
        "--cases rl_steps".split()
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["engine"] for r in lines] == ["continuous", "partial"]
    full, part = lines
    assert full["staleness_mean"] == full["stale_token_frac"] == 0.0
    assert full["extra_groups"] == 0 and part["extra_groups"] == 2
    assert 0 <= part["staleness_mean"] <= part["staleness_max"] <= 2
    assert part["step_s"] > 0 and full["trained_tokens_per_s"] > 0


def test_rollout_benchmark_length_cases_print_one_line_per_engine_and_slot_count(capsys):
    from benchmarks import rollout

    rollout.main(
        "--d-model 16 --ffn 32 --layers 1 --heads 2 --kv-heads 1 --vocab 32 --rollouts 8 "
        "--slots 4,0 --mean-len 3 --max-over-mean 2 --repeats 1 --cases heavy_tail,equal".split()
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    engines = [(r["case"], r["engine"], r["slots"]) for r in lines]
    assert engines == [
        (case, engine, slots)
        for case in ("heavy_tail", "equal")
        for engine, slots in (
            ("static", 8),
            ("static_chunked", 4),
            ("continuous", 4),
            ("continuous", 8),
        )
    ]
    for r in lines:  # the same requests, so the same useful tokens, whatever the engine
        assert r["useful_tokens"] == lines[0 if r["case"] == "heavy_tail" else 4]["useful_tokens"]
        assert 0 < r["slot_utilization"] <= 1 and r["tokens_per_s"] > 0
    equal = [r for r in lines if r["case"] == "equal"]
    assert all(r["slot_utilization"] == 1.0 and r["useful_tokens"] == 24 for r in equal)
