"""The READMEs as a newcomer runs them.

Every command in README.md's and README.zh-CN.md's code blocks that starts a server or sends a request
is run here and must answer: a command that starts a server is parsed by the real CLI and started once
(in process, on the shared engine, or on a LoRA-capable one when its flags turn LoRA on; a `--model`
path is parsed but not loaded, since no model is downloaded in tests), and the requests of the same
section go to it, the others to the shared live server, `127.0.0.1:9990` rewritten to its port.
Commands that only fetch or copy models, run the test suite or print something are classified and
left alone; one this file does not know fails, so a new kind of command is never skipped by accident.

Beside it, the user-facing documents' house rules: README.md at most 350 lines, and no work notes
(numbered work sessions, performance "bars", issue numbers) in README.md, README.zh-CN.md or docs/.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.conftest import ServerThread, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
READMES = ["README.md", "README.zh-CN.md"]
DOCUMENTED_PORT = "9990"

# Commands that neither start a server nor send a request: model downloads and copies (network, minutes),
# the test suite, installs, and local tools whose output the reader reads.
OTHER_COMMANDS = ("make test", "make install", "pip ", "hf ", "huggingface-cli ", "modelscope ", "scp ", "cp ",
                  "HF_ENDPOINT=", "export ", "ls ", "cd ", ".venv/bin/python -c ")


@dataclasses.dataclass
class Block:
    section: str
    lang: str
    text: str


def code_blocks(markdown: str) -> list[Block]:
    """Fenced code blocks with the level-2 heading they sit under."""
    blocks, section, fence, lang = [], "", None, ""
    lines: list[str] = []
    for line in markdown.splitlines():
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            m = re.match(r"^(```+)\s*(\S*)", line)
            if m:
                fence, lang, lines = m.group(1), m.group(2).lower(), []
        elif line.startswith(fence):
            blocks.append(Block(section, lang, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(line)
    return blocks


def shell_commands(text: str) -> list[str]:
    """One entry per command: backslash continuations joined, quotes spanning lines kept together, a heredoc
    with its body; trailing `  # comments` dropped outside heredocs."""
    commands, current, heredoc_end = [], "", None
    for line in text.splitlines():
        if heredoc_end is not None:
            current += line + "\n"
            if line.strip() == heredoc_end:
                commands.append(current)
                current, heredoc_end = "", None
            continue
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        line = re.sub(r"\s{2,}#\s.*$", "", line)
        current += line + "\n"
        m = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if m:
            heredoc_end = m.group(1)
            continue
        if line.endswith("\\"):
            continue
        try:
            shlex.split(current)
        except ValueError:  # a quote still open: the command goes on
            continue
        commands.append(current)
        current = ""
    assert heredoc_end is None and not current.strip(), f"unterminated command: {current!r}"
    return commands


def kind_of(command: str) -> str:
    """'server', 'request', 'setup' (needed by a later request: run, cheap), 'parse' (a spark-server command
    checked by the CLI's parser only) or 'other'."""
    words = words_of(command)
    head = " ".join(words[:2])
    if words[0] == "make" and words[1:2] == ["serve"]:
        return "server"
    if words[0].endswith("spark-server"):
        if words[1] == "serve":
            return "server"
        if words[1:3] == ["lora", "push"]:
            return "request"
        if words[1:3] == ["lora", "pack"]:
            return "setup"
        return "parse"
    if words[0] == "curl" or (words[0].endswith("python") and "<<" in command and DOCUMENTED_PORT in command):
        return "request"
    if command.startswith(OTHER_COMMANDS) or head.startswith(OTHER_COMMANDS):
        return "other"
    raise AssertionError(f"the README check does not know this command; classify it in {__file__}: {command}")


def words_of(command: str) -> list[str]:
    """The shell words of a command (before any heredoc), its backslash continuations joined."""
    return shlex.split(command.split("<<")[0].replace("\\\n", " "))


def serve_argv(command: str) -> list[str]:
    """The `spark-server` arguments a server command stands for (`make serve VAR=...` included)."""
    words = words_of(command)
    if words[0] == "make":
        env = dict(w.split("=", 1) for w in words[2:] if "=" in w)
        return ["serve", "--host", env.get("HOST", "127.0.0.1"), "--port", env.get("PORT", DOCUMENTED_PORT)]
    return words[1:]


def cli_args(argv: list[str]) -> dict:
    from spark_server.cli import build_parser

    args = vars(build_parser().parse_args(argv))  # an unknown flag or a bad value fails here (SystemExit)
    for key in ("func", "command", "lora_command"):
        args.pop(key, None)
    return args


class Servers:
    """Starts each documented server once, in process: the shared engine unless the flags turn LoRA on."""

    def __init__(self, stack: ExitStack, engine, workdir: Path) -> None:
        self.stack, self.engine, self.workdir, self.lora_engine = stack, engine, workdir, None

    def start(self, command: str, port: int) -> None:
        from spark_server.app import build_app
        from spark_server.settings import resolve_with_sources

        argv = serve_argv(command.replace(f":{DOCUMENTED_PORT}", f":{port}"))
        settings, _ = resolve_with_sources(cli_args(argv), environ={})
        settings = dataclasses.replace(settings, host="127.0.0.1", port=port,
                                       lora_cache_dir=settings.lora_cache_dir or str(self.workdir / "lora-cache"))
        engine = self.engine
        if settings.lora_enabled:
            engine = self._lora_engine(settings)
        app = build_app(settings, engine, owns_engine=False)
        self.stack.enter_context(ServerThread(app, port))
        wait_healthy(f"http://127.0.0.1:{port}", timeout=60)

    def _lora_engine(self, settings):
        if self.lora_engine is None:
            from engine.async_engine import AsyncEngine

            config = dataclasses.replace(settings.engine_config(), max_num_seqs=4, kv_cache_space_gib=0.25,
                                         kv_cache_prefault=False, max_loras=2)
            self.lora_engine = AsyncEngine.from_config(config)
            self.lora_engine.start()
            self.stack.callback(self.lora_engine.shutdown)
        return self.lora_engine


def answered(out: str) -> str | None:
    """Why an answer is an error, or None: an OpenAI / bridge `error` or a non-zero Spark `header.code`."""
    if '"error"' in out:
        return "an error answer"
    for m in re.finditer(r'"code"\s*:\s*(-?\d+)', out):
        if m.group(1) != "0":
            return f"Spark code {m.group(1)}"
    return None


def run_readme(name: str, workdir: Path, live_server, async_engine, monkeypatch) -> list[str]:
    """Runs the README's server and request commands; returns what ran, for the assertions."""
    blocks = code_blocks((ROOT / name).read_text(encoding="utf-8"))
    for link in (".venv", "examples"):
        (workdir / link).symlink_to(ROOT / link)
    monkeypatch.chdir(workdir)  # relative paths in documented flags (--lora-pack-dir ./packs) land here
    ran: list[str] = []
    with ExitStack() as stack:
        servers = Servers(stack, async_engine, workdir)
        ports: dict[str, int] = {}
        for block in blocks:
            if block.lang == "python":
                if DOCUMENTED_PORT in block.text:
                    commands = [f".venv/bin/python - <<'PY'\n{block.text}PY\n"]
                else:  # a script a later command needs (the LoRA walkthrough's adapter): run as written
                    exec(compile(block.text, f"{name}: {block.section}", "exec"), {"__name__": "__main__"})
                    ran.append(f"setup script in {block.section}")
                    continue
            elif block.lang in ("sh", "bash", "shell", "console", ""):
                commands = shell_commands(block.text)
            else:
                continue  # json, yaml: not commands
            for command in commands:
                kind = kind_of(command)
                if kind == "other":
                    continue
                if kind == "parse":
                    cli_args(words_of(command)[1:])
                    continue
                if kind == "server":
                    ports[block.section] = free_port()
                    servers.start(command, ports[block.section])
                    ran.append(f"server: {command.strip()}")
                    continue
                port = ports.get(block.section, live_server.port)
                text = command.replace(f"localhost:{DOCUMENTED_PORT}", f"127.0.0.1:{DOCUMENTED_PORT}")
                text = text.replace(f"127.0.0.1:{DOCUMENTED_PORT}", f"127.0.0.1:{port}")
                if kind == "request" and "lora push" not in text:
                    body = text + "".join((workdir / f).read_text() for f in re.findall(r"-d @(\S+)", text))
                    assert "max_tokens" in body, f"{name}: a documented request without a small max_tokens: {text}"
                proc = subprocess.run(["bash", "-c", text], cwd=workdir, capture_output=True, text=True, timeout=180)
                assert proc.returncode == 0, f"{name}: {command}\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
                if kind == "request":
                    assert proc.stdout.strip() or ">" in text, f"{name}: no answer to {command}"
                    why = answered(proc.stdout)
                    assert why is None, f"{name}: {why} from {command}\n{proc.stdout[-1500:]}"
                ran.append(f"{kind}: {command.strip()}")
    return ran


@pytest.mark.parametrize("name", READMES)
def test_every_documented_command_answers(name, tmp_path, live_server, async_engine, monkeypatch):
    ran = run_readme(name, tmp_path, live_server, async_engine, monkeypatch)
    assert any(r.startswith("server:") for r in ran), f"{name}: no server command found"
    assert any(r.startswith("request:") for r in ran), f"{name}: no request command found"


# --- house rules for the documents users read ----------------------------------------------------------

# Work notes that do not belong in user text. "session" alone stays allowed (a Spark WebSocket session is
# the protocol's own word); numbered or narrated work sessions are not.
WORK_NOTES = [
    (re.compile(r"\bsessions?[ -]?\d+", re.I), "a numbered work session"),
    (re.compile(r"\b(this|that|next|previous|same) session\b|\bsession by session\b|\bthe session's (start|end)\b",
                re.I), "a work session"),
    (re.compile(r"\bbars?\b", re.I), '"bar"'),
    (re.compile(r"\bissues?\s*#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w&/#])#\d+\b"), "an issue number"),
]


def user_documents() -> list[Path]:
    return [ROOT / n for n in READMES if (ROOT / n).exists()] + sorted((ROOT / "docs").glob("*.md"))


def offences(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in WORK_NOTES:
            m = pattern.search(line)
            if m:
                found.append(f"line {number}: {what}: {m.group(0)!r}")
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 350, f"README.md has {lines} lines; move reference material to docs/"


@pytest.mark.parametrize("path", user_documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_notes_in_user_documents(path):
    assert offences(path.read_text(encoding="utf-8")) == []


def markup_faults(text: str) -> list[str]:
    """A code fence left open (what follows it renders as code) and a heading repeated on its next heading."""
    faults, fence, last_heading = [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = None if fence else number
        elif fence is None and line.startswith("#"):
            if line == last_heading:
                faults.append(f"line {number}: {line!r} repeats the heading before it")
            last_heading = line
    if fence:
        faults.append(f"line {fence}: a code fence is never closed")
    return faults


@pytest.mark.parametrize("path", user_documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_documents_render(path):
    assert markup_faults(path.read_text(encoding="utf-8")) == []


def test_the_markup_check_can_fail():
    assert len(markup_faults("## A\n\n## A\n```sh\ncurl x\n\nprose\n")) == 2
    assert markup_faults("## A\n```py\n# a comment\n```\n## B\n") == []


def test_the_work_notes_check_can_fail():
    bad = ("Session 57: faster.\nThe bar is met.\nSee issue #10 and issue 56.\nsessions 27-53\n"
           "peers-session57.json\nthis session measured it\nfixed in #12\n")
    assert len({o.split(':')[0] for o in offences(bad)}) == 7  # every line offends
    good = ("One request per WebSocket session.\nthe `sessions` logger\n`--lora NAME=URL#md5`\n"
            "[link](#quick-start)\n&#123;\nbarrier, crowbar\n")
    assert offences(good) == []


def test_the_command_splitter_and_classifier():
    cmds = shell_commands("make serve   # a comment\n.venv/bin/python - <<'PY'\nprint(1)  # kept\nPY\n"
                          "curl -s x -d '{\n  \"a\": 1}'\nspark-server serve --a \\\n  --b\n")
    assert len(cmds) == 4 and "# kept" in cmds[1] and "# a comment" not in cmds[0]
    assert [kind_of(c) for c in ("make serve PORT=1", "curl -s 127.0.0.1:9990/health", "make test",
                                 ".venv/bin/spark-server lora check x")] == ["server", "request", "other", "parse"]
    with pytest.raises(AssertionError):
        kind_of("rm -rf /tmp/x")
    with pytest.raises(SystemExit):  # a documented flag the server does not have fails the check
        cli_args(serve_argv("spark-server serve --no-such-flag 1"))
