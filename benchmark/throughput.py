"""Where the time goes: each stage of a cleanba script alone, then the whole script, in one session.

For one script and one config (the script's own flags, after `--`) this measures
  env        envpool alone: one actor thread's envs stepped with random actions (same envpool settings)
  inference  the actor's jitted policy alone, on the actor device, on real observations (incl. device_get)
  learner    the learner alone: updates on a stored rollout, on the learner devices
  actor      one actor thread alone (the script's `actor_loop`: env + inference + storage + transfer)
  full       the script itself, as a user runs it (a subprocess), steady state: after --warmup-updates
and prints samples/s for each (median of the repeats, and the spread min..max), the serial ceiling
1 / (t_env + t_inference + t_learner) in seconds per sample, and the full run's fraction of it. With actor and
learner on separate accelerators the stages can overlap: then min(...) of the three rates is the ceiling, also
printed (on a CPU the fake devices share the same cores, so the serial ceiling is the one that applies).
The full run also reports peak RSS (the script's `stats/peak_rss_mib`) at update 10 and at its last update.
`--stages learner` measures the learner alone (on one rollout of the script's actor): its samples/s and microseconds
per sample of the batch (PPO: all its epochs), e.g. for each `--network` and `--compute-dtype` of the Atari scripts.

usage (from the repository root):
  uv run python benchmark/throughput.py --script cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py \\
      -- --env-id CartPole-v1 --local-num-envs 8 --num-actor-threads 1 --hiddens 64 64 \\
         --actor-device-ids 0 --learner-device-ids 1
  add --json FILE to append the results as one JSON line (benchmark/throughput.sh collects them).
  uv run python benchmark/throughput.py --stages learner -- --env-id Breakout-v5 --network nature \\
      --compute-dtype bfloat16
"""

import dataclasses
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Literal

from tool_helpers import python_script, read_records

from cleanrl_utils.cli import parse_flags, run_cli, run_main
from cleanrl_utils.devices import device_layout
from cleanrl_utils.errors import RunError
from cleanrl_utils.evals.evaluate import load_script
from cleanrl_utils.flags import derive_batch_values
from cleanrl_utils.run import SebulbaRun

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class HarnessArgs:
    script: Path = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
    """the cleanba script to measure: an on-policy Sebulba script (PPO, IMPALA, MuJoCo PPO, the on-policy MuJoCo one)"""
    repeats: int = 5
    """repeats of each stage measurement (the table shows the median and the spread)"""
    stage_rollouts: int = 3
    """rollouts (of --num-steps steps each) per env/inference/actor measurement, and updates per learner one"""
    full_repeats: int = 3
    """how many times the full script runs"""
    full_updates: int = 60
    """updates per full run (>= 200 to check the growth of peak RSS from update 10 to 200)"""
    warmup_updates: int = 3
    """updates of each full run left out of its steady-state SPS (compilation happens there)"""
    stages: Literal["all", "learner"] = "all"
    """all: every stage, then the full script; learner: the learner alone, on one rollout of the script's actor"""
    json: Path | None = None
    """append the results as one JSON line to this file"""
    summarize: Path | None = None
    """print the JSON lines of this file as a markdown table (for the docs) and exit"""
    baseline: Path | None = None
    """with --summarize: JSON lines of an earlier version measured in the same session (same script names and
    flags), shown as the full run's SPS and fraction before"""


def spread(rates: list[float]) -> dict:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "n": len(rates)}


def timed_rates(measure, samples: int, repeats: int) -> dict:
    """samples/s of `measure()` (which does `samples` samples of work), after one untimed warm-up call."""
    measure()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        measure()
        rates.append(samples / (time.perf_counter() - start))
    return spread(rates)


def env_stage(envs, args, harness: HarnessArgs):
    """envpool alone: (step_envs, observations), step_envs() stepping one actor thread's envs for --stage-rollouts
    rollouts with random actions drawn beforehand (so that only envpool is timed) into observations (inference's)."""
    import numpy as np

    num_envs, num_steps = args.local_num_envs, args.num_steps
    action_space = envs.action_space
    action_space.seed(args.seed)
    random_actions = np.stack([np.stack([action_space.sample() for _ in range(num_envs)]) for _ in range(num_steps)])
    envs.reset()
    observations = []

    def step_envs():
        observations.clear()
        for step in range(num_steps * harness.stage_rollouts):
            obs, *_ = envs.step(random_actions[step % num_steps])
            observations.append(obs)

    return step_envs, observations


def inference_stage(actor_fns, params, observations: list, key):
    """The actor's per-step call alone, as `actor_loop` makes it, on `observations` (incl. device_get)."""
    import jax

    def infer():
        nonlocal key
        for obs in observations:
            *outputs, key = actor_fns.act(params, obs, key)
            jax.device_get(outputs)

    return infer


def run_actor(module, args, layout, rollouts: int, *, envs, num_threads: int, actor_fns, params) -> list:
    """The script's own actor thread function for `rollouts` rollouts, the learner replaced by queues: the rollouts it
    sent."""
    import jax

    from cleanrl_utils.actors import ActorThread

    args.num_updates = rollouts
    params_queue, rollout_queue, stop_event = queue.Queue(), queue.Queue(), threading.Event()
    for version in range(rollouts):
        params_queue.put((params, version))
    thread = ActorThread(
        index=0,
        global_index=0,
        device=layout.actor_devices[0],
        learner_devices=layout.learner_devices,
        start_update=0,
        envpool_threads=num_threads,
        stop_event=stop_event,
        queue_timeout=args.queue_timeout,
    )
    module.actor_loop(
        args=args,
        thread=thread,
        key=jax.random.key(args.seed),
        make_envs=lambda seed, num_threads=0: envs,
        actor_fns=actor_fns,
        params_queue=params_queue,
        rollout_queue=rollout_queue,
    )
    return [rollout_queue.get()[0] for _ in range(rollouts)]


def learner_stage(module, args, mesh, *, agent, agent_state, stored_rollout, harness: HarnessArgs) -> dict:
    """samples/s of the learner alone: updates of the global batch (every actor thread's rollout: here copies of the
    stored one), as many as rollouts in the other stages (a small update takes only a millisecond)."""
    import jax

    from cleanrl_utils.data_path import assemble_global_rollout
    from cleanrl_utils.devices import replicate

    args.num_updates = 10**6
    update = module.make_learner_update(args, agent, mesh)
    threads = args.num_actor_threads * len(args.actor_device_ids)
    storage = assemble_global_rollout([stored_rollout] * threads, mesh, args.batch_size // args.num_steps)
    learner_state = module.LearnerState(replicate(agent_state, mesh), jax.random.key(args.seed))

    def learn():
        nonlocal learner_state
        for _ in range(harness.stage_rollouts):
            learner_state, metrics = update(learner_state, storage)
        jax.block_until_ready((learner_state, metrics))

    return timed_rates(learn, args.batch_size * harness.stage_rollouts, harness.repeats)


def measure_stages(module, args, layout, harness: HarnessArgs) -> dict:
    """samples/s of each stage alone (--stages learner: of the learner alone, on one rollout of the actor)."""
    import jax

    from cleanrl_utils.devices import envpool_num_threads

    actor_device = layout.actor_devices[0]
    rollout_samples = args.local_num_envs * args.num_steps * harness.stage_rollouts
    every_stage = harness.stages == "all"  # else the learner alone
    results = {}
    num_threads = envpool_num_threads(args.envpool_threads, args.num_actor_threads * len(layout.actor_devices))
    envs = module.make_env(args.env_id, args.seed, args.local_num_envs, num_threads=num_threads)
    step_envs, observations = env_stage(envs, args, harness)
    if every_stage:
        results["env"] = timed_rates(step_envs, rollout_samples, harness.repeats)
    agent, agent_state = module.make_agent(args, jax.random.key(args.seed))
    actor_fns = module.make_actor_fns(agent)
    params = jax.device_put(module.actor_params(agent_state), actor_device)
    if every_stage:
        key = jax.device_put(jax.random.key(args.seed), actor_device)
        infer = inference_stage(actor_fns, params, observations, key)
        results["inference"] = timed_rates(infer, rollout_samples, harness.repeats)
    # actor: env + inference + storage + transfer, one actor thread
    actor = partial(
        run_actor, module, args, layout, envs=envs, num_threads=num_threads, actor_fns=actor_fns, params=params
    )
    stored_rollout = actor(1)[0]  # also compiles
    actor_rates = []
    for _ in range(harness.repeats if every_stage else 0):
        start = time.perf_counter()
        actor(harness.stage_rollouts)
        actor_rates.append(rollout_samples / (time.perf_counter() - start))
    if every_stage:
        results["actor"] = spread(actor_rates)
    results["learner"] = learner_stage(
        module, args, layout.mesh, agent=agent, agent_state=agent_state, stored_rollout=stored_rollout, harness=harness
    )
    return results


def steady_sps(steps: list[int], times: list[float], warmup_updates: int) -> float:
    """Env steps per second from the log of update `warmup_updates` to the last: `steps` and wall `times`, one each
    per update."""
    first = warmup_updates - 1
    return (steps[-1] - steps[first]) / (times[-1] - times[first])


def measure_full_run(harness: HarnessArgs, script_args: list[str], batch_size: int) -> dict:
    """The script as a user runs it; steady-state SPS from the wall times of its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rates, rss_at_10, rss_last, device_peak = [], [], [], []
    for repeat in range(harness.full_repeats):
        with tempfile.TemporaryDirectory() as cwd:
            command = [
                sys.executable,
                str(harness.script),
                *script_args,
                "--run-name",
                f"throughput{repeat}",
                "--total-timesteps",
                str(batch_size * harness.full_updates),
                "--log-frequency",
                "1000000",
                "--checkpoint-frequency",
                "0",
            ]
            completed = subprocess.run(
                command,
                cwd=cwd,
                capture_output=True,
                text=True,
                env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
            )
            if completed.returncode != 0:
                raise RunError(f"the full run failed ({completed.returncode}):\n{completed.stderr[-2000:]}")
            accumulator = EventAccumulator(
                str(Path(cwd) / "runs" / f"throughput{repeat}"), size_guidance={"scalars": 0}
            )
            accumulator.Reload()
            events = accumulator.Scalars("charts/SPS")
            steps, times = [event.step for event in events], [event.wall_time for event in events]
            rates.append(steady_sps(steps, times, harness.warmup_updates))
            rss = [event.value for event in accumulator.Scalars("stats/peak_rss_mib")]
            rss_at_10.append(rss[min(9, len(rss) - 1)])
            rss_last.append(rss[-1])
            if "stats/device_peak_memory_mib" in accumulator.Tags()["scalars"]:  # GPU/TPU
                device_peak.append(accumulator.Scalars("stats/device_peak_memory_mib")[-1].value)
    return {
        **spread(rates),
        "peak_rss_mib_update_10": max(rss_at_10),
        "peak_rss_mib_last": max(rss_last),
        "updates": harness.full_updates,
        **({"device_peak_memory_mib": max(device_peak)} if device_peak else {}),
    }


def print_table(results: dict, platform: str, separate_devices: bool):
    def row(name, stats, note=""):
        print(
            f"{name:<28}{stats['median']:>12,.0f}{1e6 / stats['median']:>12,.1f}   "
            f"{stats['min']:>9,.0f} .. {stats['max']:<9,.0f}{note}"
        )

    print(f"{'stage':<28}{'samples/s':>12}{'us/sample':>12}   {'spread (min .. max)':<22}")
    for name, label in [
        ("env", "env (random actions)"),
        ("inference", "inference (actor device)"),
        ("learner", "learner (one update)"),
        ("actor", "actor thread alone"),
    ]:
        if name in results:
            row(label, results[name])
    if "full" not in results:  # --stages learner
        return
    ceiling = results["serial_ceiling"]
    print(f"{'serial ceiling':<28}{ceiling:>12,.0f}{1e6 / ceiling:>12,.1f}   1/(t_env + t_inference + t_learner)")
    row(
        "full script (steady state)",
        results["full"],
        f"  {results['fraction_of_serial_ceiling']:.0%} of the serial ceiling",
    )
    overlapped = results["overlapped_ceiling"]
    note = "" if separate_devices and platform != "cpu" else " (not reachable here: the devices share the CPU cores)"
    print(f"{'overlapped ceiling':<28}{overlapped:>12,.0f}{1e6 / overlapped:>12,.1f}   min of the three{note}")
    full = results["full"]
    print(
        f"peak RSS: {full['peak_rss_mib_update_10']:,.0f} MiB at update 10, {full['peak_rss_mib_last']:,.0f} MiB at "
        f"update {full['updates']} ({full['peak_rss_mib_last'] / full['peak_rss_mib_update_10'] - 1:+.1%})"
        + (
            f"; peak device memory {full['device_peak_memory_mib']:,.0f} MiB"
            if "device_peak_memory_mib" in full
            else ""
        )
    )


def summarize(path: Path, baseline: Path | None):
    """One markdown row per measured config: samples/s of each stage, the learner's microseconds per sample, ceiling,
    full run, fraction, peak RSS ("-" where a config measured the learner alone: --stages learner)."""
    key = lambda r: (r["script"], tuple(r["args"]))
    rows = read_records(
        path, "--summarize", keys=("script", "args")
    )  # both read before the table starts: a bad file is the only output
    before = {key(r): r for r in read_records(baseline, "--baseline", keys=("script", "args"))} if baseline else {}
    print(
        "| script | config | env | inference | learner | learner us/sample | serial ceiling | full | of ceiling |"
        + (" before: full, of ceiling |" if baseline else "")
        + " peak RSS (MiB) |"
    )
    print("|-" * (10 + bool(baseline)) + "|")
    for r in rows:
        config = " ".join(r["args"])
        for flag in ["--actor-device-ids 0 ", "--learner-device-ids 1 ", "--learner-device-ids 1"]:
            config = config.replace(flag, "")
        rates = " | ".join(
            f"{r[stage]['median']:,.0f}" if stage in r else "-" for stage in ["env", "inference", "learner"]
        )
        learner = f"{1e6 / r['learner']['median']:,.1f}"
        old = before.get(key(r))
        old = (
            f" {old['full']['median']:,.0f}, {old['fraction_of_serial_ceiling']:.0%} |"
            if old and "full" in old
            else " - |" * bool(baseline)
        )
        if "full" in r:
            full = f"{r['serial_ceiling']:,.0f} | {r['full']['median']:,.0f} | {r['fraction_of_serial_ceiling']:.0%} |"
            rss = f"{r['full']['peak_rss_mib_last']:,.0f}"
        else:
            full, rss = "- | - | - |", "-"
        name = r["script"].removeprefix("cleanba_").split("_envpool")[0]
        print(f"| {name} | `{config.strip()}` | {rates} | {learner} | {full}{old} {rss} |")


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    harness = parse_flags(HarnessArgs, argv[:split])
    harness.script = harness.script.resolve()  # the full runs start in a temporary folder
    if harness.summarize:
        return run_main(summarize, harness.summarize, harness.baseline)
    script_args = argv[split + 1 :]
    # the contract's names this tool calls: an on-policy Sebulba script's
    parts = ("evaluation", "run", "sebulba", "on-policy learner")
    module = run_main(lambda: load_script(python_script(harness.script, "--script"), parts))
    return run_cli(partial(measure, harness, module, script_args), module.Args, script_args)


def measure(harness: HarnessArgs, module, script_args: list[str], args):
    """Every stage, then the full script (or the learner alone), for one config of one script (in this process: one
    process's layout)."""
    module.validate_args(args)
    layout = device_layout(args)  # starts JAX's backend, with the host devices the ids need
    import jax

    derive_batch_values(
        args, world_size=layout.world_size, local_rank=layout.local_rank, **SebulbaRun.env_copies(args, layout)
    )
    module.check_runtime_values(args, layout)
    print(f"{harness.script.name} {' '.join(script_args)}")
    print(
        f"{jax.local_devices()[0].platform}: {jax.local_device_count()} device(s), {os.cpu_count()} cores, "
        f"batch {args.batch_size} samples/update"
    )
    results = measure_stages(module, args, layout, harness)
    if harness.stages == "all":
        results["full"] = measure_full_run(harness, script_args, args.batch_size)
        rates = [results[name]["median"] for name in ["env", "inference", "learner"]]
        results["serial_ceiling"] = 1 / sum(1 / rate for rate in rates)
        results["overlapped_ceiling"] = min(rates)
        results["fraction_of_serial_ceiling"] = results["full"]["median"] / results["serial_ceiling"]
    separate_devices = not set(args.actor_device_ids) & set(args.learner_device_ids)
    print_table(results, jax.local_devices()[0].platform, separate_devices)
    if harness.json:
        with open(harness.json, "a") as f:
            f.write(json.dumps({"script": harness.script.name, "args": script_args, **results}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
