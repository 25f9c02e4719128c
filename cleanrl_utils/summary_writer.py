"""TensorBoard event files with the tensorboard package alone (no TensorFlow or PyTorch), and W&B if tracked."""

import glob
import json
import os
import re
import socket
import time

from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from cleanrl_utils.run_folder import atomic_write

# names without "tfevents": TensorBoard reads every file whose name holds it
REWRITTEN = ".events-rewrite.tmp"
JOURNAL = ".events-rewrite.json"


def finish_rewrite(logdir: str):
    """Complete a rewrite that a crash interrupted after its journal was written (roll forward): the rewritten
    file takes its final name, the files it replaces go. Before the journal, the half-written file is dropped."""
    journal, rewritten = os.path.join(logdir, JOURNAL), os.path.join(logdir, REWRITTEN)
    if os.path.exists(journal):
        with open(journal) as file:
            plan = json.load(file)
        if os.path.exists(rewritten):
            os.replace(rewritten, os.path.join(logdir, plan["final"]))
        for name in plan["remove"]:
            if os.path.exists(os.path.join(logdir, name)):
                os.remove(os.path.join(logdir, name))
        os.remove(journal)
    elif os.path.exists(rewritten):
        os.remove(rewritten)


def rewrite_events(logdir: str, keep_up_to_step: int):
    """The run's event files become one file that holds what they logged up to `keep_up_to_step`, each step of
    each tag once (from the newest file that has it), crash-safe: the new file is written under a temporary name,
    then a journal (written atomically) says which name it takes and which files go; a kill anywhere leaves either
    the old files or, after `finish_rewrite` (at the next start), the new one alone."""
    finish_rewrite(logdir)
    earlier_files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    if not earlier_files:
        return
    # by step and tag, not by step alone: a file that logged other tags at the same steps (an earlier tool's, a
    # second writer's) must not replace the run's values there, and a value logged twice is kept once
    events, newest = [], {}  # newest: (step, tag) -> (event number, value number) of its newest value
    for path in earlier_files:
        for record in RawEventFileLoader(path).Load():  # raw: EventFileLoader would convert the values
            event = event_pb2.Event.FromString(record)
            if event.HasField("summary") and keep_up_to_step > 0 and event.step <= keep_up_to_step:
                for i, value in enumerate(event.summary.value):
                    newest[event.step, value.tag] = len(events), i
                events.append(event)
    with open(os.path.join(logdir, REWRITTEN), "wb") as file:
        records = RecordWriter(file)
        records.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        for n in sorted(range(len(events)), key=lambda n: events[n].step):  # stable: a step's events in file order
            event = events[n]
            values = [value for i, value in enumerate(event.summary.value) if newest[event.step, value.tag] == (n, i)]
            if values:
                records.write(
                    event_pb2.Event(
                        wall_time=event.wall_time, step=event.step, summary=summary_pb2.Summary(value=values)
                    ).SerializeToString()
                )
        file.flush()
        os.fsync(file.fileno())
    # the oldest name with a new suffix: it sorts before the new run's file (TensorBoard reads files in order); a
    # name no file has, as the files the journal lists are removed after the rename
    oldest = os.path.basename(earlier_files[0])
    generation = re.search(r"\.rewrite(\d+)$", oldest)
    base, number = (oldest[: generation.start()], int(generation.group(1)) + 1) if generation else (oldest, 1)
    while os.path.exists(os.path.join(logdir, f"{base}.rewrite{number}")):
        number += 1
    atomic_write(
        os.path.join(logdir, JOURNAL),
        json.dumps(
            {"final": f"{base}.rewrite{number}", "remove": [os.path.basename(path) for path in earlier_files]}
        ).encode(),
    )
    finish_rewrite(logdir)


class SummaryWriter:
    """TensorBoard event files via the tensorboard package alone (no TF/torch), and W&B if tracked. Written in the
    calling thread: a full disk or a lost permission is an OSError naming the file, where the run can report it."""

    def __init__(self, logdir: str, use_wandb: bool, resume_step: int):
        """A run that starts again (resumed, or restarted after a crash) keeps what its earlier event files
        logged up to resume_step and drops the rest, so its curves continue without duplicated steps (a step
        logged out of order would make TensorBoard discard everything after it)."""
        os.makedirs(logdir, exist_ok=True)
        rewrite_events(logdir, resume_step)
        self.path = os.path.join(
            logdir, f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        )
        self.file = open(self.path, "ab")
        self.records = RecordWriter(self.file)
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.use_wandb = use_wandb

    def add_event(self, event):
        try:
            self.records.write(event.SerializeToString())
        except OSError as error:
            raise OSError(error.errno, error.strerror, self.path) from None

    def flush(self):
        try:
            self.file.flush()
        except OSError as error:
            raise OSError(error.errno, error.strerror, self.path) from None

    def add_scalars(self, scalars: dict, step: int):
        values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)))
        if self.use_wandb:
            import wandb

            wandb.log(scalars, step=step)

    def add_text(self, tag: str, text: str):
        tensor = tensor_pb2.TensorProto(
            dtype="DT_STRING", string_val=[text.encode()], tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[])
        )
        metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)
        self.add_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=[value])))

    def close(self):
        if not self.file.closed:
            try:
                self.file.close()
            except OSError:  # already reported by the write that failed
                pass
