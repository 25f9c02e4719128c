"""The code's pointers into the docs: every `README.md#anchor` / `docs/PAGE.md#anchor` named in a docstring or
comment is a heading that exists (anchors as mkdocs makes them), and no pointer is written as prose ("README: the
learner loop") that no test can follow; and the pages' "ends at `update=N/N global_step=M`" lines are what their
commands' flags give."""

import re

from conftest import REPO
from markdown.extensions.toc import slugify

CODE = [*REPO.glob("cleanba/*.py"), *REPO.glob("cleanrl_utils/**/*.py"), *REPO.glob("benchmark/*.py")]
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


def commands_and_their_end_lines(page) -> list[tuple[list[str], list[tuple[int, int, int]]]]:
    """The commands of a page's bash blocks, each group with the `update=N/N global_step=M` lines said of it: in the
    comment lines just above the commands (up to the next comment), or in the prose after a block (its commands)."""
    text = page.read_text()
    blocks = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S))
    found = []
    for block, following in zip(blocks, [*blocks[1:], None]):
        if block.group(1) != "bash":
            continue
        groups = [([], [])]  # (commands, ends) after each comment
        for line in block.group(2).replace("\\\n", " ").splitlines():
            if line.startswith("#"):
                if groups[-1][0]:
                    groups.append(([], []))
                groups[-1][1].extend(tuple(map(int, match)) for match in END_LINE.findall(line))
            elif "cleanba/cleanba_" in line:
                groups[-1][0].append(" ".join(line.split()))
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
