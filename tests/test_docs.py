"""The code's pointers into the docs: every `README.md#anchor` / `docs/PAGE.md#anchor` named in a docstring or
comment is a heading that exists (anchors as mkdocs makes them), and no pointer is written as prose ("README: the
learner loop") that no test can follow; and the pages' "ends at `update=N/N global_step=M`" lines are what their
commands' flags give; and the house rules of the pages: no date or load clause in a page, the README a front page
(at most 150 lines, no test count)."""

import json
import re
import shlex
import statistics
import sys

from conftest import REPO
from markdown.extensions.toc import slugify

sys.path.insert(0, str(REPO / "benchmark"))  # as a tool run from there has it
from tool_helpers import quiet  # noqa: E402

CODE = [*REPO.glob("cleanba/*.py"), *REPO.glob("cleanrl_utils/**/*.py"), *REPO.glob("benchmark/*.py")]
README = REPO / "README.md"
POINTER = re.compile(r"\b(README\.md|docs/[\w./-]+\.md)(?:#([\w-]+))?")


def anchors(page) -> set[str]:
    """The anchors mkdocs gives a page's headings (Python-Markdown's toc slugify, outside code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slugify(heading, "-") for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.MULTILINE)}


def test_every_pointer_in_the_code_names_a_page_and_heading_that_exist():
    found, broken = 0, []
    for path in CODE:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for page, anchor in POINTER.findall(line):
                found += 1
                target = REPO / page
                if not target.is_file():
                    broken.append(f"{path.relative_to(REPO)}:{number}: no page {page}")
                elif anchor and anchor not in anchors(target):
                    broken.append(f"{path.relative_to(REPO)}:{number}: {page} has no heading #{anchor}")
    assert not broken, "\n".join(broken)
    assert found >= 5  # the scripts' pointers (e.g. docs/performance.md#on-a-gpu) are found


def test_no_pointer_is_written_as_prose():
    prose = re.compile(r"\((README|docs)\s*:")
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in CODE
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if prose.search(line)
    ]
    assert not hits, "write pointers as README.md#anchor or docs/PAGE.md#anchor:\n" + "\n".join(hits)


def test_anchors_are_the_ones_mkdocs_makes():
    """The test's slugs against headings whose mkdocs anchors the docs already link to."""
    assert "on-a-gpu" in anchors(REPO / "docs" / "performance.md")
    assert "the-sebulba-system-every-script" in anchors(REPO / "docs" / "rl-algorithms" / "ppo.md")
    assert "the-readmes-cartpole-command-ten-seeds" in anchors(REPO / "docs" / "rl-algorithms" / "muzero.md")


END_LINE = re.compile(r"update=(\d+)/(\d+) global_step=(\d+)")


def commented_commands(block: str) -> list[tuple[str, list[str]]]:
    """A bash block's commands, each group with the comment lines just above it (up to the next comment)."""
    groups = [("", [])]
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("#"):
            if groups[-1][1]:
                groups.append(("", []))
            groups[-1] = (f"{groups[-1][0]} {line[1:].strip()}".strip(), groups[-1][1])
        elif "cleanba/cleanba_" in line:
            groups[-1][1].append(" ".join(line.split()))
    return [(comment, commands) for comment, commands in groups if commands]


def commands_and_their_end_lines(page) -> list[tuple[list[str], list[tuple[int, int, int]]]]:
    """The commands of a page's bash blocks, each group with the `update=N/N global_step=M` lines said of it: in the
    comment lines just above the commands (up to the next comment), or in the prose after a block (its commands)."""
    text = page.read_text()
    blocks = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S))
    found = []
    for block, following in zip(blocks, [*blocks[1:], None]):
        if block.group(1) != "bash":
            continue
        groups = [
            (commands, [tuple(map(int, end)) for end in END_LINE.findall(comment)])
            for comment, commands in commented_commands(block.group(2))
        ]
        prose = text[block.end() : following.start() if following else len(text)]
        commands = [command for group in groups for command in group[0]]
        groups.append((commands, [tuple(map(int, match)) for match in END_LINE.findall(prose)]))
        found += [(commands, ends) for commands, ends in groups if commands and ends]
    return found


def last_console_line(command: str) -> tuple[int, int, int]:
    """(update, num_updates, global_step) of a one-process command's last console line, from its parsed flags and the
    batch every script derives (cleanrl_utils.flags.derive_batch_values, with the run's env copies)."""
    from types import SimpleNamespace

    from cleanrl_utils.cli import parse_flags
    from cleanrl_utils.evals.evaluate import load_script
    from cleanrl_utils.flags import SebulbaArgs, derive_batch_values
    from cleanrl_utils.run import AnakinRun, SebulbaRun

    words = command.split()
    script = next(word for word in words if word.startswith("cleanba/cleanba_"))
    module = load_script(REPO / script)
    args = parse_flags(module.Args, words[words.index(script) + 1 :])
    layout = SimpleNamespace(
        actor_devices=getattr(args, "actor_device_ids", []), learner_devices=args.learner_device_ids
    )
    run = SebulbaRun if isinstance(args, SebulbaArgs) else AnakinRun
    derive_batch_values(args, world_size=1, local_rank=0, **run.env_copies(args, layout))
    return args.num_updates, args.num_updates, args.num_updates * args.batch_size


def test_the_end_lines_the_pages_promise_are_the_commands_own():
    """ "ends at `update=N/N global_step=M`" after a README or docs command is what the command's flags give."""
    checked, wrong = 0, []
    for page in [REPO / "README.md", *REPO.glob("docs/**/*.md")]:
        if page.name == "index.md":  # the README itself
            continue
        for commands, ends in commands_and_their_end_lines(page):
            computed = [last_console_line(command) for command in commands]
            checked += len(ends)
            wrong += [f"{page.relative_to(REPO)}: {end} is none of {computed}" for end in ends if end not in computed]
    assert not wrong, "\n".join(wrong)
    assert checked >= 8  # the README's one-per-algorithm CPU commands say where they end


# "under 30 s", "about 3 min", "40 s each", "in under a minute": a README command's promised wall time
PROMISED_TIME = re.compile(r"\b(under |about )?(a|\d+) (s|min|minute)\b")


def run_key(command: str) -> tuple[str, frozenset] | None:
    """A command's script and flags (the seed left out), however they are ordered or wrapped."""
    words = shlex.split(command)
    script = next((word for word in words if word.startswith("cleanba/cleanba_")), None)
    if script is None:
        return None
    flags, name = {}, None
    for word in words[words.index(script) + 1 :]:
        if word.startswith("--"):
            name = word
            flags[name] = ()
        else:
            flags[name] += (word,)
    flags.pop("--seed", None)
    return script, frozenset(flags.items())


def recorded_wall_times() -> dict[tuple[str, frozenset], list[float]]:
    """The quiet wall times benchmark/readme_commands.py (and learning_runs.py) recorded for each command, oldest
    first."""
    times = {}
    for results in sorted((REPO / "benchmark" / "results").glob("*.jsonl")):
        for line in results.read_text().splitlines():
            record = json.loads(line)
            key = run_key(record.get("command", ""))
            # one seed a run, on a quiet machine (benchmark/tool_helpers.py's `quiet`)
            one_seed = "seeds_in_the_process" not in record and len(record.get("seeds", [None])) == 1
            if key is not None and "wall_s" in record and one_seed and quiet(record):
                times.setdefault(key, []).append(record["wall_s"])
    return times


QUIET_RUNS = 3  # the fewest quiet runs of a command its promised time may rest on (up to its newest ten)


def test_the_readmes_run_times_are_what_quiet_runs_recorded():
    """Each README CPU command's promised time against its newest quiet recorded runs (at least three, at most ten):
    "under N" is at least their longest, "about N" (or a bare "N") within 30% of their median (timings vary by that
    much between machines)."""
    recorded, checked, wrong = recorded_wall_times(), 0, []
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S)
    for comment, commands in [group for block in blocks for group in commented_commands(block)]:
        promises = PROMISED_TIME.findall(comment.split("ends at")[0])
        if not promises:  # the test command
            continue
        kind, number, unit = promises[0]  # the command's own (a clause after it may time a variant)
        seconds = (1 if number == "a" else int(number)) * (60 if unit != "s" else 1)
        for command in commands:
            times = recorded.get(run_key(command), [])[-10:]
            assert len(times) >= QUIET_RUNS, f"fewer than {QUIET_RUNS} quiet recorded runs of {command}"
            checked += 1
            longest, median = max(times), statistics.median(times)
            if kind == "under " and longest > seconds:
                wrong.append(f"{comment!r}: the longest of {len(times)} quiet runs took {longest} s")
            if kind != "under " and not seconds / 1.3 <= median <= seconds * 1.3:
                wrong.append(f"{comment!r}: the median of {len(times)} quiet runs is {median} s")
    assert not wrong, "\n".join(wrong)
    assert checked >= 11  # the quick start's and the ten below it


def test_the_readmes_lag_sentence_is_its_tables():
    """ "from update N on the learner trains on data one version older than its params": the README's timeline table
    (actor `vX -> rK`, learner `rK: vA -> vB`) gives lag 0 before update N and 1 from it on."""
    text = README.read_text()
    actor_version = {int(k): int(v) for v, k in re.findall(r"v(\d+) -> r(\d+)", text)}
    learner_version = {int(k): int(a) for k, a in re.findall(r"r(\d+): v(\d+) -> v\d+", text)}
    lags = [learner_version[k] - actor_version[k] for k in sorted(learner_version)]
    first = int(
        re.search(r"from update (\d+) on the\s+learner\s+trains\s+on\s+data\s+one\s+version\s+older", text).group(1)
    )
    assert lags == [0] * (first - 1) + [1] * (len(lags) - first + 1), lags


# The house rules of the docs: a page says what was measured, where and how often; when, and beside what other load,
# are records of the run (benchmark/results/*.jsonl and the notes benchmark/results/notes_*.md), not the manual's.
DATE = re.compile(
    r"\b(?:19|20)\d{2}-\d{2}-\d{2}\b"  # an ISO date
    r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.? \d{1,2}(?:st|nd|rd|th)?,? (?:19|20)\d{2}\b"
    r"|\b\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.? (?:19|20)\d{2}\b"
    r"|\b(?:today|yesterday|this (?:session|morning|afternoon|evening|week)|last (?:night|session))\b",
    flags=re.IGNORECASE,
)
LOAD = re.compile(
    r"\b(?:other|background|heavy|some) load\b|\bunder (?:heavy |some )?load\b|\bload average\b"
    r"|\bother (?:work|jobs|sessions)\b|\bbeside (?:other|another) (?:runs?|work|jobs?|sessions?|tests?|benchmarks?)\b"
    r"|\bbeside (?:a|the) (?:test run|test suite|package install|benchmark run)\b"
    r"|\b(?:quiet|busy|loaded|shared) (?:\d+-core )?(?:machine|host|cpu|cores|moment)\b|\blowest priority\b"
    r"|\banother day\b|\bbenchmark lock\b",
    flags=re.IGNORECASE,
)


def house_rule_breaks(pattern: re.Pattern, paths) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for match in pattern.finditer(line)
    ]


def test_no_page_has_a_date_or_a_load_clause():
    """A docs page (README.md included: docs/index.md) says what was measured, where and how often; the date of a run
    and the load beside it go to its record and the page's notes (benchmark/results/notes_*.md)."""
    pages = sorted(REPO.glob("docs/**/*.md"))
    assert REPO / "docs" / "index.md" in pages and len(pages) >= 20
    breaks = house_rule_breaks(DATE, pages) + house_rule_breaks(LOAD, pages)
    assert not breaks, "move these to the page's notes (benchmark/results/notes_*.md):\n" + "\n".join(breaks)


# "638 tests", "656 passed", "the tests (638;", "the quick tier 519 in 3 min": a count that is stale by the next test
TEST_COUNT = re.compile(
    r"\b\d[\d,]*\s+(?:tests?|passed|failed|skipped|selected|deselected|errors?)\b"
    r"|\btests?\s*\(\s*\d[\d,]*\s*[;,)]"
    r"|\b(?:quick tier|suite|tests?)\s+(?:of\s+)?\d[\d,]*\b(?!\s*(?:s|min|minutes?|seconds?|x)\b)"
)


def test_the_readme_is_a_front_page_without_a_test_count():
    """The README is the front page: at most 150 lines, and no count of the tests (it is stale by the next test
    added; contributing.md keeps the suite's time budget and how to measure it)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move details to docs/"
    counts = house_rule_breaks(TEST_COUNT, [README])
    assert not counts, "README.md states a test count:\n" + "\n".join(counts)
