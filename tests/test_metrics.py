"""Metrics writer (JSONL + TensorBoard), progress line, masked summaries, stage timer."""

import io
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.metrics import (
    MetricsWriter,
    Progress,
    StageTimer,
    by_step,
    masked_mean,
    read_metrics,
    summarize,
)


def test_writer_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.write(1, {"loss": jnp.float32(0.5), "n": np.int64(3), "ok": True, "lr": 1e-3})
        w.write(2, {"loss": float("nan"), "kl": jnp.array(float("inf")), "n": 4})
        w.write(2, {"eval/accuracy": 0.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]  # strict JSON: no NaN/Infinity tokens
    assert parsed[0] == {"step": 1, "loss": 0.5, "n": 3, "ok": 1, "lr": 1e-3}
    assert parsed[1] == {"step": 2, "loss": None, "kl": None, "n": 4}
    assert isinstance(parsed[0]["n"], int)

    records = read_metrics(tmp_path)
    assert math.isnan(records[1]["loss"]) and math.isnan(records[1]["kl"])
    merged = by_step(records)
    assert [r["step"] for r in merged] == [1, 2]
    assert merged[1]["eval/accuracy"] == 0.25 and merged[1]["n"] == 4

    events = [f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out.tfevents")]
    assert len(events) == 1

    tags = _tb_scalar_tags(tmp_path / "tb" / events[0])
    assert {("loss", 1), ("n", 2), ("eval/accuracy", 2)} <= tags


def _tb_scalar_tags(path):
    """(tag, step) pairs of a TB event file, parsed with the record framing + protobuf."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    out, i = set(), 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 8], "little")
        event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
        i += 12 + n + 4  # length, length crc, payload, payload crc
        out |= {(v.tag, event.step) for v in event.summary.value}
    return out


def test_writer_appends_and_rejects_bad_values(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(1, {"a": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            w.write(2, {"step": 3})
        with pytest.raises(ValueError, match=r"metrics\['v'\]: expected a scalar"):
            w.write(2, {"v": np.ones(2)})
    with MetricsWriter(tmp_path, tensorboard=False) as w:  # a resumed run appends
        w.write(1, {"a": 2.0})
    assert not (tmp_path / "tb").exists()
    assert [r["a"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0]
    assert by_step(read_metrics(tmp_path)) == [{"step": 1, "a": 2.0}]


def test_read_metrics_skips_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1}]
    path.write_text('{"step": 1, "a"\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":1:"):
        read_metrics(path)


def test_progress_non_tty_prints_plain_lines():
    out = io.StringIO()
    with Progress(10, stream=out, every_steps=4, every_s=1e9, enabled=True) as p:
        for step in range(1, 11):
            p.update(step, reward=0.5, accuracy=jnp.float32(0.25), tokens_per_s=1234.5)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # First update, then every 4 steps, and always the last.
    assert [line.split(" ")[1] for line in lines] == ["1/10", "5/10", "9/10", "10/10"]
    assert lines[0] == "step 1/10 (10%) | reward 0.5 | accuracy 0.25 | tokens_per_s 1234"
    assert "s/step" in lines[-1] and lines[-1].endswith("ETA 0:00:00")


def test_progress_eta_from_step_times():
    p = Progress(100, stream=io.StringIO(), enabled=True, ema=1.0)
    p._last = (10, time.perf_counter() - 2.0)  # steps 11..20 took 2 s: 0.2 s/step
    p.update(20)
    assert p._sec_per_step == pytest.approx(0.2, rel=0.05)
    assert p.format(20, {}).endswith("ETA 0:00:16")  # 80 steps * 0.2 s


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_tty_redraws_in_place():
    out = _FakeTTY()
    p = Progress(3, stream=out, enabled=True, tty_interval_s=0.0)
    p.update(1, reward=0.123456)
    p.update(2)
    p.update(3)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "reward 0.1235" in text


def test_progress_disabled_and_closed_stream():
    out = io.StringIO()
    Progress(5, stream=out, enabled=False).update(1)
    assert out.getvalue() == ""
    out.close()
    p = Progress(5, stream=out, enabled=True)
    p.update(1)  # must not raise: a progress line never stops training
    assert not p.enabled


@pytest.mark.parametrize("jit", [False, True])
def test_masked_mean_and_summarize(jit):
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, jnp.nan, -6.0]])
    mask = jnp.array([[True, True, False], [True, False, True]])
    mm = jax.jit(masked_mean) if jit else masked_mean
    summ = jax.jit(summarize, static_argnums=0) if jit else summarize
    assert float(mm(x, mask)) == pytest.approx((1 + 2 + 4 - 6) / 4)
    assert float(mm(jnp.array([1.0, 3.0]))) == 2.0
    assert float(mm(x, jnp.zeros_like(mask))) == 0.0  # empty mask -> 0, not NaN

    s = summ("adv", x, mask)
    # values 1, 2, 4, -6: mean 0.25, population variance (0.5625+3.0625+14.0625+39.0625)/4
    assert float(s["adv/mean"]) == pytest.approx(0.25)
    assert float(s["adv/std"]) == pytest.approx(math.sqrt(56.75 / 4))
    assert float(s["adv/min"]) == -6.0 and float(s["adv/max"]) == 4.0

    empty = summ("e", x, jnp.zeros_like(mask))
    assert {k: float(v) for k, v in empty.items()} == {
        "e/mean": 0.0,
        "e/std": 0.0,
        "e/min": 0.0,
        "e/max": 0.0,
    }
    lengths = summ("len", jnp.array([3, 5], jnp.int32))
    assert float(lengths["len/std"]) == 1.0 and float(lengths["len/max"]) == 5.0


def test_masked_mean_shape_mismatch():
    with pytest.raises(ValueError, match="mask"):
        masked_mean(jnp.ones((2, 3)), jnp.ones((3, 2), bool))


def test_stage_timer_blocks_on_output():
    timer = StageTimer()

    @jax.jit
    def slow(x):
        return jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a @ a), x)

    x = jnp.eye(256) * 0.5
    slow(x).block_until_ready()  # compile outside the timed stage
    with timer("update") as stage:
        out = stage.block(slow(x))
    assert out.shape == (256, 256)
    with timer("score"):
        time.sleep(0.01)
    with timer("score"):
        time.sleep(0.01)
    m = timer.results()
    assert set(m) == {"time/update_s", "time/score_s"}
    assert m["time/score_s"] >= 0.02
    # Blocking means the stage covers the compute (~60 ms for 200 256x256 matmuls here);
    # the async dispatch alone takes ~0.2 ms.
    assert m["time/update_s"] > 0.01
    assert timer.results() == {}


def _plot_script():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "plot_metrics.py"
    spec = importlib.util.spec_from_file_location("plot_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(workdir):
    with MetricsWriter(workdir, tensorboard=False) as w:
        for step in range(1, 6):
            w.write(step, {"reward/correct/mean": step / 10, "loss": float("nan")})
            if step % 2 == 1:
                w.write(step, {"eval/accuracy": step / 5})


def test_plot_series_and_key_selection(tmp_path):
    script = _plot_script()
    _write_run(tmp_path)
    records = read_metrics(tmp_path)
    assert script.select_keys(records, ["eval/*", "reward/*/mean", "eval/accuracy"]) == [
        "eval/accuracy",
        "reward/correct/mean",
    ]
    assert script.series(records, "eval/accuracy") == ([1, 3, 5], [0.2, 0.6, 1.0])
    assert script.series(records, "loss") == ([], [])  # NaN points are gaps
    with pytest.raises(SystemExit):
        script.main([str(tmp_path), "--keys", "nope/*"])


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    script = _plot_script()
    _write_run(tmp_path / "run_a")
    _write_run(tmp_path / "run_b")
    out = tmp_path / "curve.png"
    assert script.main([str(tmp_path / "run_a"), str(tmp_path / "run_b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
