"""The README and docs/ point only at what exists: relative links and their anchors, repository paths and
test names, config keys, `make` targets, `ftkit` command lines, `accelerate launch` lines and scripts.

Nothing is run: commands are split with shlex and parsed by the real parsers (ftkit's and accelerate's).
Every problem names the page and line."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

# Fences whose lines are commands; `console` lines are commands only after a `$ ` prompt. Output and
# synopses (with [optional] and <placeholder> parts) go in `text` fences, which are not checked.
SHELL = {"bash", "sh", "shell", "console"}
OPERATOR = re.compile(r"^[();<>|&]+$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
# Paths under these root entries are not in the repository: build outputs and run directories.
NOT_IN_REPO = {".git", ".venv", "runs", "build", "dist", ".pytest_cache", ".ruff_cache", "__pycache__"}
FILE_SUFFIXES = {
    "py", "yaml", "yml", "json", "jsonl", "md", "txt", "sh", "sbatch", "png", "safetensors", "pt", "bin",
    "lock", "parquet", "csv", "toml", "log",
}  # fmt: skip
RECIPES = {"sft", "dpo", "grpo", "rm", "embed"}
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
TEST_FILE = re.compile(r"^test_\w+\.py$")


@dataclass
class Block:
    lang: str
    first_line: int
    """Line number of the block's first line inside the fence."""
    lines: list[str]


@dataclass
class Page:
    path: Path
    text: str

    @property
    def name(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    @functools.cached_property
    def parsed(self) -> tuple[str, list[Block]]:
        """The prose (fenced lines blanked, so offsets keep their line numbers) and the fenced blocks."""
        prose, blocks, fence, block = [], [], None, None
        for number, line in enumerate(self.text.split("\n"), start=1):
            match = FENCE.match(line)
            if fence is None and match:
                fence, block = match.group(1), Block(match.group(2).lower(), number + 1, [])
                blocks.append(block)
                line = ""
            elif fence is not None:
                if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                    fence = None
                else:
                    block.lines.append(line)
                line = ""
            prose.append(line)
        return "\n".join(prose), blocks

    @property
    def prose(self) -> str:
        return self.parsed[0]

    @property
    def blocks(self) -> list[Block]:
        return self.parsed[1]

    def where(self, offset: int) -> str:
        line = self.prose.count("\n", 0, offset) + 1
        return f"{self.name}:{line}"

    @functools.cached_property
    def anchors(self) -> set[str]:
        seen: dict[str, int] = {}
        for line in self.prose.split("\n"):
            match = HEADING.match(line)
            if match:
                base = slug(match.group(1))
                seen[base] = seen.get(base, 0) + 1
        return {base if i == 0 else f"{base}-{i}" for base, n in seen.items() for i in range(n)}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def read_page(path: Path) -> Page:
    return Page(path, path.read_text(encoding="utf-8"))


@functools.cache
def repo_roots() -> set[str]:
    return {p.name for p in REPO.iterdir() if p.name not in NOT_IN_REPO and not p.name.endswith(".egg-info")}


@functools.cache
def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", makefile, re.M))


@functools.cache
def config_keys() -> tuple[set[str], set[str]]:
    """Every `section.key` (and top-level key) of the recipes' config schemas, and the section names."""
    from toolkit.config import RecipeConfig
    from toolkit.grpo.config import GrpoRecipeConfig
    from toolkit.preference.config import PreferenceConfig

    keys, sections = set(), set()
    for schema in (RecipeConfig, PreferenceConfig, GrpoRecipeConfig):
        config = schema()
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if dataclasses.is_dataclass(value):
                sections.add(field.name)
                keys |= {f"{field.name}.{inner.name}" for inner in dataclasses.fields(value)}
            else:
                keys.add(field.name)
    return keys, sections


@functools.cache
def find_test_file(name: str) -> Path | None:
    found = sorted((REPO / "tests").rglob(name))
    return found[0] if found else None


class WordChecker:
    """Repository paths, test names and config keys in code spans and command arguments. A `::test`
    without a file refers to the file named last before it."""

    def __init__(self) -> None:
        self.last_test_file: Path | None = None

    def problems(self, word: str, key: bool = False) -> list[str]:
        """`key`: the word is in a key's place (a span's first word, a command's key=value)."""
        word = word.strip("\"'(),;")
        if not word:
            return []
        return self.path_problems(word) + (key_problems(word) if key else [])

    def path_problems(self, word: str) -> list[str]:
        path, _, test = word.partition("::")
        test = test.split("[")[0].split("::")[-1]
        if not path:
            return self.test_problems(self.last_test_file, test) if test and self.last_test_file else []
        if any(c in path for c in "<>{}$~=") or "..." in path or ":" in path:
            return []
        if TEST_FILE.match(path):
            found = find_test_file(path)
            if found is None:
                return [f"{path} is not a file under tests/"]
            self.last_test_file = found
            return self.test_problems(found, test)
        if path.split("/")[0] not in repo_roots() or ("/" not in path and not (REPO / path).is_file()):
            return []
        if "*" in path:
            return [] if list(REPO.glob(path.rstrip("/"))) else [f"{path} matches no file in the repository"]
        target = REPO / path
        if not target.exists():
            return [f"{path} does not exist in the repository"]
        if path.endswith("/") and not target.is_dir():
            return [f"{path} is not a folder"]
        if target.is_file() and target.relative_to(REPO).parts[0] == "tests":
            self.last_test_file = target
        return self.test_problems(target, test)

    @staticmethod
    def test_problems(file: Path, test: str) -> list[str]:
        if not test:
            return []
        if re.search(rf"^\s*(async\s+)?def {re.escape(test)}\b", file.read_text(encoding="utf-8"), re.M):
            return []
        return [f"{file.relative_to(REPO).as_posix()} has no test {test}"]


def key_problems(word: str) -> list[str]:
    keys, sections = config_keys()
    match = re.match(r"^([a-z_]+)\.([A-Za-z_]\w*)(.*)$", word)
    if not match or match.group(1) not in sections or match.group(2) in FILE_SUFFIXES:
        return []
    if match.group(3).startswith(".") or "/" in match.group(3):
        return []
    key = f"{match.group(1)}.{match.group(2)}"
    if key in keys:
        return []
    return [f"{key} is not a config key (see toolkit/config.py)"]


def link_problems(page: Page) -> list[str]:
    problems = []
    prose = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), page.prose)
    for match in LINK.finditer(prose):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.path.parent / path).resolve() if path else page.path
        where = page.where(match.start())
        if dest != REPO and REPO not in dest.parents:
            problems.append(f"{where}: link {target} leaves the repository")
        elif path and not dest.exists():
            problems.append(f"{where}: link {target}: {path} does not exist")
        elif anchor and dest.suffix == ".md":
            anchors = page.anchors if dest == page.path else read_page(dest).anchors
            if anchor not in anchors:
                problems.append(f"{where}: link {target}: no heading #{anchor} in {dest.name}")
    return problems


def span_problems(page: Page) -> list[str]:
    """Repository paths, tests and config keys in code spans; `make X` and `ftkit X` spans."""
    problems, words = [], WordChecker()
    for match in CODE_SPAN.finditer(page.prose):
        where, span = page.where(match.start()), match.group(1)
        found = [p for i, word in enumerate(span.split()) for p in words.problems(word, key=i == 0)]
        problems += [f"{where}: {p}" for p in found]
        program, name = (span.split() + ["", ""])[:2]
        if program == "make" and re.match(r"^[\w.-]+$", name) and name not in make_targets():
            problems.append(f"{where}: make {name}: no such target in the Makefile")
        if program == "ftkit" and re.match(r"^[a-z][\w-]*$", name) and not ftkit_has_subcommand(name):
            problems.append(f"{where}: ftkit {name}: no such subcommand")
    return problems


def fence_problems(page: Page) -> list[str]:
    return [
        f"{page.name}:{block.first_line - 1}: name the fence's language (bash for commands, console "
        "for $-prompted sessions, text for output and synopses)"
        for block in page.blocks
        if not block.lang
    ]


def commands(block: Block) -> list[tuple[int, list[str]]]:
    """(line, tokens) of each simple command in a shell fence, split at shell operators."""
    logical, pending, start = [], "", 0
    for offset, line in enumerate(block.lines):
        if block.lang == "console" and not pending:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if not pending:
            start = block.first_line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append((start, pending + line))
        pending = ""
    found = []
    for number, line in logical:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segment: list[str] = []
        for token in [*lexer, ";"]:
            if OPERATOR.match(token):
                while segment and ENV_ASSIGNMENT.match(segment[0]):
                    segment.pop(0)
                if segment:
                    found.append((number, segment))
                segment = []
            else:
                segment.append(token)
    return found


def command_problems(page: Page) -> list[str]:
    problems = []
    for block in page.blocks:
        if block.lang not in SHELL:
            continue
        for number, tokens in commands(block):
            words = WordChecker()
            found = [p for token in tokens for p in words.problems(token, key="=" in token)]
            found += one_command_problems(tokens)
            problems += [f"{page.name}:{number}: {p} (in: {shlex.join(tokens)})" for p in found]
    return problems


def one_command_problems(tokens: list[str]) -> list[str]:
    program, args = Path(tokens[0]).name, tokens[1:]
    if program == "make":
        return [
            f"make {t}: no such target in the Makefile"
            for t in args
            if not t.startswith("-") and "=" not in t and t not in make_targets()
        ]
    if program == "ftkit":
        return ftkit_problems(args)
    if program == "accelerate" and args[:1] == ["launch"]:
        return launch_problems(args[1:])
    if re.match(r"^python(3(\.\d+)?)?$", program) and args and args[0] != "-m":
        script = next((a for a in args if not a.startswith("-")), None)
        if script and absent(script):
            return [f"python {script}: no such script"]
    return []


@contextlib.contextmanager
def captured():
    """What a parser prints is kept out of the test's output; its stderr comes back."""
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        yield stderr


def last_line(stream: io.StringIO, default: str) -> str:
    return (stream.getvalue().strip().splitlines() or [default])[-1]


@contextlib.contextmanager
def parsing_only():
    """ftkit's real parser, with the command it would run replaced by a recorder."""
    from toolkit.commands import cli

    parsed = []
    with mock.patch.object(cli, "_run", side_effect=lambda args: parsed.append(args) or 0):
        yield cli.main, parsed


def ftkit_problems(argv: list[str]) -> list[str]:
    with parsing_only() as (main, parsed), captured() as stderr:
        try:
            main(argv)
        except SystemExit as exc:
            return [f"ftkit does not parse it: {last_line(stderr, f'exit {exc.code}')}"] if exc.code else []
    if len(parsed) != 1:
        return ["ftkit did not reach its command (the parse-only hook missed it)"]
    args = parsed[0]
    if args.command != "train":
        return []
    problems = []
    if args.backend != "auto" and not (REPO / "accelerate_configs" / f"{args.backend}.yaml").is_file():
        problems.append(f"ftkit train --backend {args.backend}: no accelerate_configs/{args.backend}.yaml")
    if args.items and "=" not in args.items[0] and args.items[0] not in RECIPES:
        problems.append(f"ftkit train {args.items[0]}: not a recipe ({', '.join(sorted(RECIPES))})")
    if args.config and absent(args.config):
        problems.append(f"ftkit train --config {args.config}: no such file")
    return problems


@functools.cache
def ftkit_has_subcommand(name: str) -> bool:
    with parsing_only() as (main, _), captured():
        try:
            main([name, "--help"])
        except SystemExit as exc:
            return not exc.code
    return True


def launch_problems(argv: list[str]) -> list[str]:
    from accelerate.commands.launch import launch_command_parser

    with captured() as stderr:
        try:
            args = launch_command_parser().parse_args(argv)
        except SystemExit as exc:
            return [f"accelerate launch does not parse it: {last_line(stderr, f'exit {exc.code}')}"]
    problems = []
    if args.config_file and absent(args.config_file):
        problems.append(f"--config_file {args.config_file}: no such file")
    if absent(args.training_script):
        problems.append(f"{args.training_script}: no such script")
    rest = args.training_script_args
    for flag, value in zip(rest, rest[1:]):
        if flag == "--config" and absent(value):
            problems.append(f"--config {value}: no such file")
    return problems


def absent(path: str) -> bool:
    """A file a command needs is missing, and the path check of its words has not said so already."""
    return not (REPO / path).is_file() and not WordChecker().path_problems(path)


def all_problems(page: Page) -> list[str]:
    return link_problems(page) + span_problems(page) + fence_problems(page) + command_problems(page)


def test_the_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md: {lines} lines, at most {README_MAX_LINES}: move the details to a page under docs/"
    )


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_anchors_paths_keys_and_commands_exist(path):
    problems = all_problems(read_page(path))
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_reachable_from_the_readme():
    linked = {
        (README.parent / m.group(1).partition("#")[0]).resolve()
        for m in LINK.finditer(read_page(README).prose)
    }
    missing = [p.relative_to(REPO).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links to none of: {', '.join(missing)}"


def test_the_checks_find_what_they_check():
    """A check that silently matched nothing would pass any page."""
    page = read_page(README)
    shell = [tokens for block in page.blocks if block.lang in SHELL for _, tokens in commands(block)]
    programs = {
        Path(tokens[0]).name + (" " + tokens[1] if tokens[0] == "accelerate" else "") for tokens in shell
    }
    assert {"make", "ftkit", "accelerate launch"} <= programs, programs
    assert LINK.search(page.prose) and CODE_SPAN.search(page.prose)
    assert "train.max_steps" in config_keys()[0] and {"demo", "test"} <= make_targets()


PROBE = REPO / "docs" / "probe.md"


def fenced(lang: str, command: str) -> tuple[int, str]:
    """A fence on line 2 of the probe page: its command is on line 3."""
    return 3, f"```{lang}\n{command}\n```"


BROKEN = {  # what is broken -> (the line a problem must name, the text after the probe's heading)
    "a link to a missing page": (2, "[x](missing.md)"),
    "a link to a missing heading": (2, "[x](../README.md#no-such-heading)"),
    "a link to a missing heading of its own page": (2, "[x](#no-such-heading)"),
    "a missing repository path": (2, "see `recipes/no_such_recipe.py`"),
    "a missing folder": (2, "see `toolkit/no_such_package/`"),
    "a missing test": (2, "`tests/unit/test_docs.py::test_no_such_test`"),
    "a test missing from the file named before": (2, "`test_docs.py::test_what_exists_passes`, `::nope`"),
    "a missing config key": (2, "`train.no_such_key=1`"),
    "a missing make target in prose": (2, "run `make no-such-target`"),
    "a missing ftkit subcommand in prose": (2, "run `ftkit no-such-command`"),
    "a fence without a language": (2, "```\nmake demo\n```"),
    "a missing make target": fenced("bash", "make no-such-target"),
    "an ftkit option that does not exist": fenced("bash", "ftkit plan --model x --no-such-option"),
    "an ftkit train backend that does not exist": fenced("console", "$ ftkit train --backend none"),
    "an ftkit train recipe that does not exist": fenced("bash", "ftkit train sftt --backend ddp"),
    "a config key in a command": fenced("bash", "ftkit train --backend ddp train.no_such_key=3"),
    "an accelerate launch option that does not exist": fenced(
        "bash", "accelerate launch --no-such-option recipes/finetune_llm.py"
    ),
    "an accelerate config that does not exist": fenced(
        "bash", "accelerate launch --config_file accelerate_configs/none.yaml recipes/finetune_llm.py"
    ),
    "a recipe config that does not exist": fenced(
        "bash", "x=1 && accelerate launch recipes/finetune_llm.py \\\n    --config recipes/configs/none.yaml"
    ),
    "a script that does not exist": fenced("sh", "python scripts/no_such_script.py --pairs"),
}


@pytest.mark.parametrize(("line", "text"), BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_reference_is_reported_with_its_page_and_line(line, text):
    problems = all_problems(Page(PROBE, f"# Probe\n{text}\n"))
    assert len(problems) == 1 and problems[0].startswith(f"docs/probe.md:{line}: "), problems


def test_what_exists_passes():
    text = """# Probe

## A heading, with `code`

[up](../README.md#two-commands), [here](#a-heading-with-code), `toolkit/train/`, `runs/demo/final`,
`accelerate_configs/<x>.yaml`, `model.safetensors`, `data.train`, `make demo-tools`, `ftkit plan`,
`test_docs.py::test_what_exists_passes`, `::test_the_readme_is_a_front_door`

```console
$ ftkit train dpo --backend zero3 train.max_steps=2 -- --num_machines 1  # a comment
output naming nothing/that/exists.py
```

```bash
make install && source .venv/bin/activate
accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 \\
    recipes/dpo_llm.py --config recipes/configs/demo-dpo.yaml dpo.beta=0.5
python -m pytest tests/unit/test_docs.py -q
```

```text
ftkit train [sft|dpo] <anything>
```
"""
    assert all_problems(Page(PROBE, text)) == []
