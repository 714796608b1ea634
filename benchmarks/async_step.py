"""Steps/s of asynchronous training (`jaxrl_llm.async_train`) by max staleness and device split.

    python -m benchmarks.async_step            # defaults: about 3 minutes on 2 CPU cores

prints one JSON line per (rl.asynchronous.max_staleness K, device layout) on the quickstart
config's shape (`jaxrl_llm/configs/quickstart.py`: the shipped base policy, P x G =
128 x 4 rollouts of up to 10 tokens, the trainer's own stages, rewards, chain and
checkpointing), --steps steps per setting, no evaluation. The host is exposed as 2 JAX
devices (XLA's host platform device count, set here before JAX starts unless XLA_FLAGS
already sets it), so both layouts use the same 2 devices (cores):

  * "shared" (rl.asynchronous.rollout_devices = 0): the sampler thread and the update run on
    one 2-device data-parallel mesh, their programs interleaved;
  * "split" (rollout_devices = 1): the sampler on device 1, the update on device 0, the
    policy copied device to device after each update and the batch copied back.

K = 0 is the synchronous schedule (sample, then update with the same params); K = 1, 2
let the sampler run 1, 2 policy versions ahead. steps_per_s = timed steps / the wall time
from the end of step --warmup to the end of the last step (each measured when the
trainer writes that step's metrics: the first --warmup steps, which compile, are not
timed; everything the loop does per step is). wait_s is the mean time per timed step
the update waited for a batch; sample_s / prepare_s / update_s the mean sampler, chain
(with K > 0 also the proximal policy's forward pass) and update stage times (the
sampler's overlap the others when K > 0). The settings share one compilation cache (a temporary
directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax

from benchmarks._common import emit, use_host_devices
from jaxrl_llm import async_train, metrics, trainer
from jaxrl_llm.configs import quickstart

LAYOUTS = {"shared": 0, "split": 1}


def config(k: int, rollout_devices: int, steps: int, data_dir: str):
    c = quickstart.get_config()
    c.rl.asynchronous.update(max_staleness=k, rollout_devices=rollout_devices)
    c.data.data_dir = data_dir
    c.train.update(steps=steps, eval_every=0, checkpoint_every=0, progress=False)
    return c


def run_setting(k: int, layout: str, args, data_dir: str) -> dict:
    c = config(k, LAYOUTS[layout], args.steps, data_dir)
    t0 = time.perf_counter()
    run = trainer.setup(c)
    logged: dict[int, float] = {}  # step -> wall clock when its metrics were written

    class Writer(metrics.MetricsWriter):
        def write(self, step, record):
            logged[step] = time.perf_counter()
            super().write(step, record)

    try:
        with tempfile.TemporaryDirectory() as workdir:
            original, metrics.MetricsWriter = metrics.MetricsWriter, Writer
            try:
                async_train.train_async(run, workdir)
            finally:
                metrics.MetricsWriter = original
            rows = metrics.by_step(metrics.read_metrics(workdir))
    finally:
        run.reward_fns.close()
    total_s = time.perf_counter() - t0
    timed = [r for r in rows if r["step"] > args.warmup]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in timed)
    step_s = (logged[args.steps] - logged[args.warmup]) / len(timed)
    return {
        "benchmark": "async_step",
        "max_staleness": k,
        "layout": layout,
        "steps_per_s": 1.0 / step_s,
        "step_s": step_s,
        "wait_s": mean("time/wait_s"),
        "sample_s": mean("time/sample_s"),
        "prepare_s": mean("time/prepare_s"),  # K > 0: includes the proximal policy pass
        "update_s": mean("time/update_s"),
        "staleness_mean": mean("async/staleness/mean"),
        "is_weight": mean("train/is_weight") if k else 1.0,
        "reward": mean("reward/total/mean"),
        "timed_steps": len(timed),
        "total_s": total_s,  # setup, compilation and every step
        "rollouts": c.rl.prompts_per_step * c.rl.group_size,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="steps per setting (warmup included)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (compilation)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--data-dir", default="", help="TFDS directory (default: a temporary one)")
    args = p.parse_args(argv)
    use_host_devices(2)  # before JAX starts a backend (unless XLA_FLAGS sets a count)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if jax.device_count() < 2 and "split" in args.layouts:
        print("async_step: 'split' needs 2 devices; skipped", file=sys.stderr)
        args.layouts = [x for x in args.layouts if x != "split"]
    with tempfile.TemporaryDirectory() as tmp:
        jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        data_dir = args.data_dir or os.path.join(tmp, "tfds")
        for layout in args.layouts:
            for k in args.staleness:
                emit(run_setting(k, layout, args, data_dir))


if __name__ == "__main__":
    main()
