"""Upstream Cleanba's PPO beside ours: the steady SPS of each on the same machine, one right after the other.

    python benchmark/upstream_cleanba.py --cleanba-ppo benchmark/upstream/cleanba_ppo.py \\
        --results OUT/gpu_cleanba_upstream.jsonl --logs OUT/cleanba_upstream_logs

--cleanba-ppo is a copy of `cleanba/cleanba_ppo.py` from github.com/vwxyzjn/cleanba (kept out of this repository:
benchmark/upstream/ is git-ignored). It runs with only the edits in EDITS, which today's JAX, flax and envpool need
(each with its reason; the run stops with one `error:` line if one no longer applies), from a patched copy in a
temporary folder. Both scripts get the same env, envs per actor thread, actor threads, steps, epochs, minibatches,
CNN sizes, devices and seed, and upstream `--concurrency` (its actor one policy version behind the learner, as ours
by default; upstream's default today is lag 0). What no flag makes equal: upstream's Atari settings are Machado et
al.'s (sticky actions 0.25, the 18 actions of the full action space, no life loss; ours are IMPALA's), envpool's
thread count is its default, its learner is one `pmap`ped program per update (`lax.scan` over epochs and minibatches;
ours a Python loop over one compiled minibatch step), and it sets `XLA_PYTHON_CLIENT_MEM_FRACTION=0.6`. Its imports
are all in uv.lock (rich through tyro, tensorboardX through playground's brax; its flax.jax_utils.replicate works with
today's JAX from flax 0.12.7 on, the lock has 0.12.8); W&B and its own cleanrl_utils load only with --track and
--save-model, which it is not given.

The measure is the same for both: env steps per second from the log of update --warmup-updates to the last, by wall
time (benchmark/throughput.py's steady state), ours from its `charts/SPS` TensorBoard events, upstream's from the
moment each of its actor's `global_step=` console lines arrives (its TensorBoard events reach the disk every 2
minutes, and not at all if it is stopped). The warm-up leaves out compilation: upstream's pmap compiles at its first
and second update, and its actor logs update k before the learner's update k - 1 is done. Upstream's run is stopped
after --timeout s (its SPS then from the updates it logged). One JSON line goes to --results with both and their
ratio, ours over upstream's; upstream's console log goes to --logs.
"""

import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tool_helpers import machine

from cleanrl_utils.cli import fail, read_input, run_cli

REPO = Path(__file__).resolve().parent.parent
# jax.device_put_sharded's in-line replacement (as flax 0.12.7 in-lined it): the shards stacked, split over the devices
DEVICE_PUT_SHARDED = """

def device_put_sharded(shards, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("learner_devices",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("learner_devices"))
    return jax.device_put(jnp.stack(shards), sharding)
"""
AGENT_PARAMS_CONTAINS = """
    def __contains__(self, key):
        return False
"""
# (old text, new text, how many times upstream has it, why): applied in order, each must match exactly
EDITS = [
    ("jax.tree_map(", "jax.tree.map(", 4, "jax.tree_map was removed in JAX 0.6"),
    (
        "jax.device_put_replicated(key, learner_devices)",
        "flax.jax_utils.replicate(key, devices=learner_devices)",
        1,
        "jax.device_put_replicated is gone from JAX 0.10 (deprecated in 0.8.1); flax's replicate replaces it",
    ),
    (
        "jax.device_put_sharded(",
        "device_put_sharded(",
        3,
        "jax.device_put_sharded is gone from JAX 0.10 (deprecated in 0.8.1)",
    ),
    (
        "\n@dataclass\nclass Args:",
        f"{DEVICE_PUT_SHARDED}\n\n@dataclass\nclass Args:",
        1,
        "defines device_put_sharded above Args: the stacked shards put with a sharding over the learner devices",
    ),
    (
        "    critic_params: flax.core.FrozenDict\n",
        f"    critic_params: flax.core.FrozenDict\n{AGENT_PARAMS_CONTAINS}",
        1,
        "flax's TrainState.create and apply_gradients now ask `key in params`: AgentParams answers no",
    ),
    (
        "        envs.num_envs = num_envs\n        envs.single_action_space = envs.action_space\n"
        "        envs.single_observation_space = envs.observation_space\n        envs.is_vector_env = True\n",
        "",
        1,
        "envpool 1.2's gym pools are gymnasium VectorEnvs: these are read-only properties with these values",
    ),
    ("next_obs = envs.reset()", "next_obs, _ = envs.reset()", 1, "gymnasium's reset returns (obs, info)"),
    (
        "next_obs, next_reward, next_done, info = envs.step(cpu_action)",
        "next_obs, next_reward, next_terminated, next_truncated, info = envs.step(cpu_action)\n"
        "            next_done = next_terminated | next_truncated",
        1,
        "gymnasium's step returns terminated and truncated apart; gym's done is either",
    ),
]


@dataclass
class Args:
    cleanba_ppo: Path
    """upstream Cleanba's cleanba/cleanba_ppo.py (github.com/vwxyzjn/cleanba), e.g. benchmark/upstream/cleanba_ppo.py"""
    results: Path
    """JSON lines, one per comparison, appended"""
    logs: Path
    """the folder of upstream's console log"""
    env_id: str = "Breakout-v5"
    local_num_envs: int = 60
    """envs per actor thread (ours' default; upstream's is 64, its README's commands use 60)"""
    num_actor_threads: int = 2
    num_steps: int = 128
    num_minibatches: int = 4
    update_epochs: int = 4
    channels: list[int] = field(default_factory=lambda: [16, 32, 32])
    hiddens: list[int] = field(default_factory=lambda: [256])
    actor_device_ids: list[int] = field(default_factory=lambda: [0])
    learner_device_ids: list[int] = field(default_factory=lambda: [0])
    seed: int = 1
    updates: int = 30
    """updates of each run"""
    warmup_updates: int = 5
    """updates of each run left out of its steady SPS (compilation happens there)"""
    ours: Path = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
    """our script"""
    timeout: float = 330
    """seconds after which upstream's run is stopped (its SPS then from the updates it logged; its actor threads
    would wait forever on a learner that failed)"""


def patched(text: str, source: Path) -> str:
    """Upstream's script with EDITS applied; one error line if one no longer matches."""
    for old, new, count, reason in EDITS:
        if (found := text.count(old)) != count:
            fail(f"--cleanba-ppo {source}: the edit for '{reason}' expects {count} of {old!r}, found {found}")
        text = text.replace(old, new)
    return text


def shared_flags(args: Args) -> list[str]:
    """The flags both scripts take, with the same meaning."""
    return [
        *("--env-id", args.env_id, "--seed", str(args.seed)),
        *("--local-num-envs", str(args.local_num_envs), "--num-actor-threads", str(args.num_actor_threads)),
        *("--num-steps", str(args.num_steps), "--num-minibatches", str(args.num_minibatches)),
        *("--update-epochs", str(args.update_epochs)),
        *("--channels", *map(str, args.channels), "--hiddens", *map(str, args.hiddens)),
        *("--actor-device-ids", *map(str, args.actor_device_ids)),
        *("--learner-device-ids", *map(str, args.learner_device_ids)),
    ]


def upstream_sps(args: Args, script: str, batch_size: int) -> tuple[float, int, bool]:
    """Upstream's run from a temporary folder, its console in --logs/upstream.log, each `global_step=` line stamped
    as it comes; stopped after --timeout s if still running. (steady SPS, updates logged, whether it was stopped)."""
    # ours is measured by throughput.py's full run, so upstream's SPS is its steady_sps too (this folder is on the
    # path of a script run from it); imported here: JAX and the scripts' modules, after the checks of the input
    from throughput import steady_sps

    flags = [*shared_flags(args), "--concurrency", "--log-frequency", "1", "--exp-name", "upstream"]
    flags += ["--total-timesteps", str(batch_size * args.updates)]
    steps, times = [], []
    with tempfile.TemporaryDirectory() as cwd, open(args.logs / "upstream.log", "w") as log:
        (Path(cwd) / "cleanba_ppo.py").write_text(script)
        process = subprocess.Popen(
            [sys.executable, "cleanba_ppo.py", *flags],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        timed_out = threading.Event()

        def stop():
            timed_out.set()  # before the kill: a SIGKILL from anyone else (the kernel's OOM killer) is not a timeout
            process.kill()

        timer = threading.Timer(args.timeout, stop)
        timer.start()
        for line in process.stdout:
            log.write(line)
            if logged := re.match(r"global_step=(\d+),", line):
                steps.append(int(logged.group(1)))
                times.append(time.time())
        timer.cancel()
        code = process.wait()
    stopped = timed_out.is_set() and code == -signal.SIGKILL
    if (code != 0 and not stopped) or len(steps) <= args.warmup_updates:
        if stopped:
            ended = f"was stopped at --timeout ({args.timeout:g} s)"
        elif code < 0:  # by a signal this runner did not send
            why = "; the kernel's out-of-memory killer sends SIGKILL" if code == -signal.SIGKILL else ""
            ended = f"was killed by signal {-code} (not by --timeout{why})"
        else:
            ended = f"failed ({code})"
        fail(f"upstream's run {ended} after {len(steps)} logged updates: its log is {log.name}")
    return steady_sps(steps, times, args.warmup_updates), len(steps), stopped


def main(args: Args) -> None:
    if not args.cleanba_ppo.is_file():
        fail(f"--cleanba-ppo {str(args.cleanba_ppo)!r} is not a file: pass upstream Cleanba's cleanba/cleanba_ppo.py")
    for name in ["local_num_envs", "num_actor_threads", "num_steps", "num_minibatches", "update_epochs", "timeout"]:
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)})")
    if not 1 <= args.warmup_updates < args.updates:
        fail(f"--warmup-updates must be in [1, --updates) (got {args.warmup_updates}, --updates {args.updates})")
    text = read_input(args.cleanba_ppo, "--cleanba-ppo", "upstream Cleanba's cleanba/cleanba_ppo.py")
    script = patched(text, args.cleanba_ppo)
    args.logs.mkdir(parents=True, exist_ok=True)
    from throughput import HarnessArgs, measure_full_run  # ours, measured as throughput.py measures a full run

    batch_size = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids) * args.num_steps
    harness = HarnessArgs(
        script=args.ours.resolve(), full_repeats=1, full_updates=args.updates, warmup_updates=args.warmup_updates
    )
    print(f"== ours: {args.ours.name}, {args.updates} updates of {batch_size} samples")
    ours = measure_full_run(harness, shared_flags(args), batch_size)["median"]
    print(f"== upstream: {args.cleanba_ppo}, {args.updates} updates, with {len(EDITS)} edits")
    theirs, upstream_updates, stopped = upstream_sps(args, script, batch_size)
    record = {
        "env_id": args.env_id,
        "flags": shared_flags(args),
        "updates": args.updates,
        "warmup_updates": args.warmup_updates,
        "upstream_updates_logged": upstream_updates,
        "upstream_stopped_by_timeout": stopped,
        "ours_sps": round(ours),
        "upstream_sps": round(theirs),
        "ours_over_upstream": round(ours / theirs, 3),
        "upstream_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "upstream_edits": [reason for _, _, _, reason in EDITS],
        "date": datetime.date.today().isoformat(),
        **machine(),
    }
    with open(args.results, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"ours {ours:,.0f} SPS, upstream {theirs:,.0f} SPS: ours / upstream = {ours / theirs:.2f}")


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
