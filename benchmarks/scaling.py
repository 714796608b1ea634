"""Scaling of one GRPO step over 1, 2, 4 and 8 devices and data / fsdp / tensor meshes.

    python -m benchmarks.scaling

(defaults: --d-model 128 --layers 2 --heads 4 --kv-heads 2 --ffn 384 --vocab 103,
--prompts 16 --group 4 --prompt-len 12 --new-tokens 10, --steps 3 --warmup 1) prints one
JSON line per mesh of --meshes (`N:axis=size,...`, e.g. `8:data=2,fsdp=2,tensor=2`). The
global batch (N = P x G rows) is the same on every mesh: this is strong scaling.

The host CPU is split into N fake JAX devices (XLA's host platform device count), which
JAX fixes when it starts, so each mesh runs in a child process (`--child SPEC`, with
XLA_FLAGS=--xla_force_host_platform_device_count=N and JAX_PLATFORMS=cpu); the parent
relays each child's JSON line unchanged and exits non-zero with the child's stderr tail
if one fails. The fake devices share the host's cores, so on a CPU step_s shows the cost
of partitioning (collectives, per-device overheads), not a speed-up; the byte counts are
what carries over to real devices.

The step is `benchmarks.grpo_step`'s (`run_step`: the trainer's own stages from
`jaxrl_llm.stages.build_stages`, sample -> score -> advantages -> update), built over the
requested mesh with the default sharding rules. Each line has:

- step_s: median wall time of the whole step over --steps steps (after --warmup untimed
  ones; compilation excluded); stages: the median of each stage's time; step_cpu_s: the
  median process CPU seconds of a step (all threads), less sensitive to a busy machine.
- state_bytes_total / state_bytes_per_device: params + optimizer state, globally and on
  the fullest device (`sharding.shard_state_bytes`): fsdp and tensor split them, data
  replicates them.
- collective_bytes_per_step: bytes of the results of the collectives (all-reduce,
  all-gather, reduce-scatter, all-to-all, collective-permute) in the compiled, SPMD-
  partitioned HLO of the update and sampler stages, i.e. the per-device output of each
  collective, summed over one execution (`hlo_collective_bytes`). It is a volume proxy,
  not wire traffic (a ring all-reduce of B bytes over n devices sends 2 (n - 1) / n B per
  device). Ops inside a while loop count once per iteration when its trip count is known:
  XLA's `known_trip_count` (scans, the first decode phase), or inferred for a counted loop
  that starts where an earlier one stopped (the sampler's later decode phases: without EOS
  ids every row decodes exactly T tokens, so each phase's exit test folds to `i < end`;
  see `_TripCounts`); else once (a static count). collective_static_loops says how many
  loops with collectives inside were counted once (0: every count is per step). XLA
  hoists loop-invariant collectives (fsdp's weight all-gathers) out of the decode loop,
  so they count once per decode phase, not per token. Score and advantages are small
  and not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import jax

from benchmarks._common import (
    block,
    emit,
    model_from_args,
)
from benchmarks.grpo_step import add_step_args, build_programs, run_step
from jaxrl_llm import sharding, stages

DEFAULT_MESHES = (
    "1:data=1",
    "2:data=2",
    "2:fsdp=2",
    "4:data=4",
    "4:fsdp=4",
    "8:data=8",
    "8:fsdp=8",
    "8:data=2,fsdp=2,tensor=2",
)
AXES = ("data", "fsdp", "tensor")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# ------------------------------------------------------------------------------ HLO text

# `  [ROOT] %name = SHAPE opcode(operands), attributes`. SHAPE may be a tuple with spaces
# and /*index=k*/ comments; the first ` word(` after it is the opcode.
_INSTR = re.compile(
    r"^\s+(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z][\w\-]*)"
    r"\((?P<operands>[^)]*)\)"
)
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([<=\d,]*)\]")
# Computations an instruction runs: fusions / calls / async wrappers, reductions,
# conditional branches, while bodies and conditions.
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_INDUCTION = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"?(\d+)')
_INIT_STEP = re.compile(
    r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"?(-?\d+)"?\s*,\s*"step"\s*:\s*"?(-?\d+)'
)
_INT_CONSTANT = re.compile(r"\b[su](?:8|16|32|64)\[\]\s+constant\((-?\d+)\)")


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    line: str

    def called(self) -> list[tuple[str, str]]:
        """(attribute, computation) pairs: calls=%f -> [("calls", "f")]."""
        return [
            (kind, callee)
            for kind, ref in _CALLED.findall(self.line)
            for callee in re.findall(r"[\w.\-]+", ref)
        ]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: `f32[64,128]{1,0}`, a tuple of shapes, `pred[]` (1
    byte per element), `s4[8]` (4 bits); token and opaque shapes count 0."""
    bits = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype == "pred":
            width = 8
        else:
            m = re.match(r"[a-z]+(\d+)", dtype)  # s32, bf16, f8e4m3fn, c64 (two f32)
            width = int(m.group(1)) if m else 0  # token[], opaque
        n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
        bits += width * n
    return bits // 8


def _parse(hlo: str) -> tuple[dict[str, dict[str, _Instr]], str]:
    """({computation: {instruction name: _Instr}} in text order, the entry's name)."""
    comps: dict[str, dict[str, _Instr]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and not line.startswith((" ", "HloModule")):
                current = m.group("name")
                comps[current] = {}
                if m.group("entry"):
                    entry = current
        elif line.startswith("}"):
            current = None
        elif m := _INSTR.match(line):
            operands = tuple(o.strip().lstrip("%") for o in m.group("operands").split(","))
            comps[current][m.group("name")] = _Instr(
                m.group("name"), m.group("shape"), m.group("op"), operands, line
            )
    if not entry:
        raise ValueError("hlo_collective_bytes: no ENTRY computation in the HLO text")
    return comps, entry


class _TripCounts:
    """Trip counts of while loops: XLA's `known_trip_count`, else inferred for a counted
    loop XLA did not annotate because its start is another loop's result (the sampler's
    decode phases, each starting where the previous one stopped).

    Inferred only when XLA found the induction variable (`known_induction_variable`, tuple
    element k), the condition holds exactly one integer constant C and one compare, a
    less-than (`i < C`, as `lax.while_loop` / `fori_loop` counters are written), and the
    start value is a constant or the induction element of an earlier such loop (which
    exits after its trip count). A step of 1 is assumed there (XLA reports the step only
    with a known start). Anything else: unknown (None)."""

    def __init__(self, comps: dict[str, dict[str, _Instr]]):
        self.comps = comps

    def trip(self, comp: str, w: _Instr) -> int | None:
        if m := _TRIP.search(w.line):
            return int(m.group(1))
        start, bound, step = self._start(comp, w), self._bound(w), self._step(w)
        if start is None or bound is None or step < 1:
            return None
        return max(0, -((start - bound) // step))  # ceil((bound - start) / step)

    @staticmethod
    def _step(w: _Instr) -> int:
        m = _INIT_STEP.search(w.line)
        return int(m.group(2)) if m else 1

    def _bound(self, w: _Instr) -> int | None:
        cond = next((c for kind, c in w.called() if kind == "condition"), None)
        lines, todo, seen = [], [cond], set()
        while todo:  # the condition and what it calls (a compare is often a fusion)
            name = todo.pop()
            if name in seen or name not in self.comps:
                continue
            seen.add(name)
            for ins in self.comps[name].values():
                lines.append(ins.line)
                todo += [c for _, c in ins.called()]
        text = "\n".join(lines)
        consts = _INT_CONSTANT.findall(text)
        if len(consts) != 1 or re.findall(r"direction=(\w+)", text) != ["LT"]:
            return None
        return int(consts[0])

    def _start(self, comp: str, w: _Instr) -> int | None:
        if m := _INIT_STEP.search(w.line):
            return int(m.group(1))
        k = _INDUCTION.search(w.line)
        init = self.comps[comp].get(w.operands[0])
        if k is None or init is None or init.op != "tuple" or int(k[1]) >= len(init.operands):
            return None
        return self._value(comp, init.operands[int(k[1])])

    def _value(self, comp: str, name: str) -> int | None:
        ins = self.comps[comp].get(name)
        if ins is None:
            return None
        if ins.op == "constant":
            return int(ins.operands[0]) if re.fullmatch(r"-?\d+", ins.operands[0]) else None
        if ins.op in ("copy", "bitcast"):
            return self._value(comp, ins.operands[0])
        if ins.op == "get-tuple-element":
            src = self.comps[comp].get(ins.operands[0])
            index = re.search(r"\bindex=(\d+)", ins.line)
            k = None if src is None else _INDUCTION.search(src.line)
            if src is None or src.op != "while" or not index or not k or k[1] != index[1]:
                return None
            start, trip = self._start(comp, src), self.trip(comp, src)
            return None if start is None or trip is None else start + trip * self._step(src)
        return None


def hlo_collective_bytes(hlo: str) -> tuple[int, int]:
    """Result bytes of the collectives one execution of an HLO module runs.

    Args:
      hlo: the text of a compiled module (`jitted.lower(*args).compile().as_text()`).
    Returns:
      (bytes, static_loops). bytes sums the result shape(s) of every all-reduce,
      all-gather, reduce-scatter, all-to-all and collective-permute, in every computation
      the entry runs (fusions, async wrappers, conditional branches counted once each:
      an upper bound for branches). An async pair (`-start` / `-done`) counts once, at the
      `-done`, whose result is the collective's result (a `-start` returns a tuple that
      also holds the operands). A while loop's body and condition count once per
      iteration when its trip count is known or inferred (`_TripCounts`), else once:
      static_loops counts those loops, when their body holds a collective.
    """
    comps, entry = _parse(hlo)
    trips = _TripCounts(comps)
    memo: dict[str, tuple[int, int]] = {}

    def visit(name: str, stack: tuple[str, ...]) -> tuple[int, int]:
        if name in memo:
            return memo[name]
        if name in stack or name not in comps:  # no recursion in HLO; unknown: nothing
            return 0, 0
        total, static = 0, 0
        for ins in comps[name].values():
            if ins.op.removesuffix("-done") in COLLECTIVES:
                total += shape_bytes(ins.shape)
            if ins.op.endswith(("-done", "-update")):
                continue  # an async op's computation runs once, counted at its -start
            trip = trips.trip(name, ins) if ins.op == "while" else None
            for kind, callee in ins.called():
                inner, s = visit(callee, (*stack, name))
                static += s
                if kind in ("body", "condition"):
                    if trip is not None:
                        inner *= trip
                    elif inner and kind == "body":
                        static += 1
                total += inner
        memo[name] = (total, static)
        return memo[name]

    return visit(entry, ())


# ------------------------------------------------------------------------------ meshes


def parse_mesh(spec: str) -> tuple[int, dict[str, int]]:
    """`N:data=2,fsdp=2,tensor=2` (N optional; missing axes are 1) -> (N, sizes)."""
    count, _, axes = spec.rpartition(":")
    sizes = dict.fromkeys(AXES, 1)
    for item in filter(None, axes.split(",")):
        key, eq, value = item.partition("=")
        if key not in AXES or not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--meshes: {spec!r}: expected axis=size with axis in {AXES}")
        sizes[key] = int(value)
    n = math.prod(sizes.values())
    if count and (not count.isdigit() or int(count) != n):
        raise ValueError(f"--meshes: {spec!r}: {count} devices != data x fsdp x tensor = {n}")
    return n, sizes


def _child_env(n: int) -> dict[str, str]:
    env = dict(os.environ)
    # The parent's own device count (if any) must not leak into the child's.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The parent's flags as a child's command line (everything but --meshes)."""
    out = []
    for key, value in vars(args).items():
        if key in ("meshes", "child") or value is None:
            continue
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def run_parent(args: argparse.Namespace) -> None:
    root = Path(__file__).resolve().parents[1]  # `-m benchmarks.scaling` resolves from here
    for spec in args.meshes:
        n, _ = parse_mesh(spec)
        cmd = [sys.executable, "-m", "benchmarks.scaling", "--child", spec, *_forwarded(args)]
        proc = subprocess.run(cmd, cwd=root, env=_child_env(n), capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode or not lines:
            tail = proc.stderr[-3000:]
            raise SystemExit(f"scaling: mesh {spec!r} failed (exit {proc.returncode}):\n{tail}")
        json.loads(lines[-1])  # a child prints exactly its record last
        print(lines[-1], flush=True)


# ------------------------------------------------------------------------------ child


def run_child(args: argparse.Namespace) -> None:
    n_dev, sizes = parse_mesh(args.child)
    if jax.device_count() != n_dev:
        raise SystemExit(f"scaling: {jax.device_count()} devices, the mesh needs {n_dev}")
    config = model_from_args(args, dtype="float32", param_dtype="float32")
    mesh = sharding.make_mesh(**sizes)
    state, inputs, st, score = build_programs(args, config, mesh)  # grpo_step's
    memory = sharding.shard_state_bytes((state.params, state.opt_state))

    # Compile the sampler and the update ahead of time and run those executables, so the
    # HLO whose collectives are counted is exactly the program that is timed (and each
    # stage compiles once).
    prompts, prompt_mask, key = inputs
    key0 = stages.key_data(key, st.replicated)
    generate = st.generate.lower(state.params, prompts, prompt_mask, key0).compile()
    rollout = block(generate(state.params, prompts, prompt_mask, key0))
    scored = stages.Scored(
        batch=st.to_batch(prompts, prompt_mask, rollout),
        rewards=score(rollout),
        truncated=rollout.truncated,
    )
    batch, _, _ = block(st.chain(scored, state.transform_state, None))
    update = st.update.lower(state, batch, {}).compile()
    sample_bytes, sample_static = hlo_collective_bytes(generate.as_text())
    update_bytes, update_static = hlo_collective_bytes(update.as_text())
    st = dataclasses.replace(st, generate=generate, update=update)

    for i in range(1 + args.warmup):  # the first also compiles score / batch / chain
        state, _, _ = run_step(state, inputs, st, score, i)
    records = []
    for i in range(args.steps):
        state, _, times = run_step(state, inputs, st, score, 1 + args.warmup + i)
        records.append(times)
    med = {k: statistics.median(r[k] for r in records) for k in records[0]}
    emit(
        {
            "benchmark": "scaling",
            "devices": n_dev,
            "mesh": sizes,
            "step_s": med["step_s"],
            "stages": {
                k: round(med[k], 4) for k in ("sample_s", "score_s", "advantages_s", "update_s")
            },
            # os.times ticks are coarse (10 ms): a fast step can read as -1e-16.
            "step_cpu_s": max(0.0, round(med["step_cpu_s"], 4)),
            "state_bytes_total": memory["total_bytes"],
            "state_bytes_per_device": memory["max_device_bytes"],
            "collective_bytes_per_step": {
                "update": update_bytes,
                "sample": sample_bytes,
                "total": update_bytes + sample_bytes,
            },
            "collective_static_loops": update_static + sample_static,
            "rows": args.prompts * args.group,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "backend": jax.default_backend(),
            "cpu_cores": len(os.sched_getaffinity(0)),
        }
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The quickstart's model and a 64-row step by default.
    add_step_args(
        p,
        d_model=128,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=384,
        vocab=103,
        prompts=16,
        group=4,
        prompt_len=12,
        new_tokens=10,
        steps=3,
        warmup=1,
    )
    p.add_argument(
        "--meshes",
        nargs="+",
        default=list(DEFAULT_MESHES),
        metavar="N:AXIS=SIZE,...",
        help="meshes to run, each in its own process",
    )
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)  # internal: one mesh
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    for spec in [args.child] if args.child else args.meshes:
        try:
            parse_mesh(spec)  # a bad spec fails here, before any child starts
        except ValueError as e:
            p.error(str(e))
    # The parent only imports JAX; each child starts it with its own device count.
    if args.child:
        run_child(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
