"""What the processes of a `--distributed` run agree on before any heavy work: their flags (`agree_on_flags`) and
one clock (`agreed_time`), through jax.distributed's collectives."""

import json
import time

import numpy as np

from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import computation_flags, flag
from cleanrl_utils.processes import distributed_started


def agreed_values(args) -> dict:
    """What every process of a run must share: the flags that shape the computation, the checkpoint schedule,
    and how many devices each process gives the actors and the learner (the batch is split by them)."""
    return {
        **computation_flags(args),
        **{
            name: getattr(args, name)
            for name in ["checkpoint_frequency", "checkpoint_keep", "resume", "heartbeat_timeout"]
        },
        "actor_device_ids (count)": len(getattr(args, "actor_device_ids", [])),
        "learner_device_ids (count)": len(args.learner_device_ids),
    }


def agree_on_flags(args):
    """Every process compares its values with everyone's before any heavy work: a mismatch is the same UsageError
    in every process, naming the flag and both values (instead of a hang or an abort deep in a collective)."""
    from jax.experimental import multihost_utils

    encoded = json.dumps(agreed_values(args), default=str).encode()
    try:
        length = int(multihost_utils.process_allgather(np.int32(len(encoded))).max())
        everyone = multihost_utils.process_allgather(np.frombuffer(encoded.ljust(length), np.uint8))
    except Exception as error:  # noqa: BLE001 - e.g. processes with different numbers of devices
        raise UsageError(
            f"--distributed: the processes could not compare their flags ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}); start every process with the same flags and as many "
            "devices (the largest of --actor-device-ids and --learner-device-ids)"
        ) from None
    tables = [json.loads(bytes(row).decode()) for row in np.asarray(everyone)]
    for name, value in tables[0].items():
        for rank, table in enumerate(tables[1:], start=1):
            if table.get(name) != value:
                raise UsageError(
                    f"the processes disagree on {flag(name)}: process 0 has {value}, process {rank} has "
                    f"{table.get(name)}; every process of a run needs the same value"
                )


def agreed_time() -> int:
    """Process 0's clock (unix seconds), the same in every process: e.g. for the default run name."""
    if not distributed_started():
        return int(time.time())
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(time.time())))
