"""vLLM's and FastDeploy's launch lines start this server: every flag of the vLLM document's `vllm serve` usage
block and of FastDeploy's launch example, read from the documents at test time, is accepted by
`spark-server serve` (or refused naming it, for a value this server cannot honour), and every ignored one is
named in the start-up log. One real start takes the document's first command form (`serve MODEL`), its
--config YAML example and a long launch line, and answers."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from spark_server import launch_compat
from spark_server import settings as settings_mod
from spark_server.cli import build_parser, main
from tests.conftest import free_port, wait_healthy
from tests.plain_http import TLS

SPECS = Path(__file__).resolve().parents[1].parent / "shared" / "specs"
VLLM_DOC = SPECS / "vllm-openai-server.zh.md"
FASTDEPLOY_DOC = SPECS / "fastdeploy-openai-api.md"


@dataclass(frozen=True)
class DocFlag:
    name: str                    # --tensor-parallel-size
    form: str                    # value | switch | optional | paired | many
    choices: tuple[str, ...] = ()
    default: str | None = None   # the document's 默认值, as written
    short: str | None = None     # -tp


def _vllm_text() -> str:
    return VLLM_DOC.read_text(encoding="utf-8")


def vllm_flags() -> list[DocFlag]:
    """The usage block's flags, with each one's short form and default from the descriptions below it."""
    text = _vllm_text()
    block = re.search(r"usage: vllm serve(.*?)```", text, re.S).group(1)
    details: dict[str, tuple[str | None, str | None]] = {}
    for m in re.finditer(r"^\*\*(--[a-z0-9-]+)(?:, (--no-[a-z0-9-]+|-[a-zA-Z-]+))?\*\*\s*$(.*?)(?=^\*\*--|^####|\Z)",
                         text, re.S | re.M):
        stated = re.search(r"默认值：(.*)", m.group(3))
        short = m.group(2) if m.group(2) and not m.group(2).startswith("--") else None
        details[m.group(1)] = (stated.group(1).strip() if stated else None, short)
    flags = []
    for item in re.findall(r"\[(--[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)?)\]", block):
        name = item.split()[0]
        if name == "-h":
            continue
        if "| --no-" in item:
            form = "paired"
        elif re.search(r"\[[A-Z_]+\]$", item):
            form = "optional"
        elif re.search(r"\[[A-Z_]+ \.\.\.\]", item):
            form = "many"
        elif len(item.split()) == 1:
            form = "switch"
        else:
            form = "value"
        listed = re.search(r"\{([^}]*)\}", item)
        default, short = details.get(name, (None, None))
        flags.append(DocFlag(name, form, tuple(listed.group(1).split(",")) if listed else (), default, short))
    return flags


def fastdeploy_lines() -> list[list[str]]:
    """FastDeploy's launch commands, as argument lists after the module name."""
    text = FASTDEPLOY_DOC.read_text(encoding="utf-8")
    commands = re.findall(r"python -m fastdeploy\.entrypoints\.openai\.api_server \\\n(.*?)```", text, re.S)
    return [shlex.split(c.replace("\\\n", " ")) for c in commands]


def fastdeploy_flags() -> list[DocFlag]:
    flags: dict[str, DocFlag] = {}
    for argv in fastdeploy_lines():
        for i, arg in enumerate(argv):
            if arg.startswith("--"):
                has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                flags[arg] = DocFlag(arg, "value" if has_value else "switch")
    return list(flags.values())


def config_example() -> str:
    """The document's --config YAML example."""
    return re.search(r"```plain\n(# config\.yaml.*?)```", _vllm_text(), re.S).group(1)


# --- values ------------------------------------------------------------------------------------------------

OWN_SAMPLES = {"host": "0.0.0.0", "model": "embedded", "tokenizer": "tokenizer-dir", "api_key": "token-abc123",
               "lora_modules": "sql=/adapters/sql", "chat_template": "{{ messages }}", "ssl_keyfile": "key.pem",
               "ssl_certfile": "cert.pem", "max_model_len": "2048", "seed": "0", "max_num_batched_tokens": "512",
               "max_num_seqs": "16", "served_model_name": "smol", "allowed_origins": '["*"]',
               "override_generation_config": '{"temperature": 0.5}'}


def _simple_default(raw: str | None) -> str | None:
    if raw is None:
        return None
    raw = raw.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", raw):
        return raw
    if re.fullmatch(r'"[^"]*"', raw):
        return raw[1:-1]
    if raw == "['*']":
        return '["*"]'
    return None


def _sample(flag: DocFlag) -> str:
    name = flag.name[2:].replace("-", "_")
    documented = _simple_default(flag.default)
    if documented is not None:
        return documented
    rule = launch_compat.active_rules().get(name)
    if rule is not None and rule.sample is not None:
        return rule.sample
    if name in OWN_SAMPLES:
        return OWN_SAMPLES[name]
    own = launch_compat.own_settings()[name]
    return str(own.default)


def argv_forms(flag: DocFlag, option: str | None = None) -> list[list[str]]:
    """Each way the flag is written on a vLLM launch line with a representative value."""
    option = option or flag.name
    if flag.choices:
        return [[option, c] for c in flag.choices]
    if flag.form == "switch":
        return [[option]]
    if flag.form == "paired":
        return [[option], ["--no-" + flag.name[2:]]]
    if flag.form == "optional":
        return [[option], [option, "true"], [option, "false"], [option + "=False"]]
    return [[option, _sample(flag)]]


# flags vLLM itself accepts only beside another one
COMPANIONS = {"--enable-reasoning": ["--reasoning-parser", "deepseek_r1"]}


@functools.lru_cache(maxsize=1)
def parser():
    return build_parser()  # one parser for every parse: building it is most of a parse's cost


def resolve(argv: list[str], env: dict[str, str] | None = None):
    args = vars(parser().parse_args(["serve", *argv]))
    args.pop("func"), args.pop("command")
    launch = launch_compat.Launch()
    settings, sources = settings_mod.resolve_with_sources(args, env or {}, launch=launch)
    return settings, sources, launch


def _named(flag: str, launch: launch_compat.Launch) -> list[str]:
    return [line for _, line in launch.notes if line.startswith(flag)]


def check_flag(flag: DocFlag, option: str | None = None) -> list[str]:
    """Every form resolves, or is refused naming the flag; at least one resolves; a foreign flag either sets
    one of our settings or leaves a start-up line naming it (an ignored one says so)."""
    name = flag.name[2:].replace("-", "_")
    foreign = name not in launch_compat.own_settings()
    accepted, problems = 0, []
    for argv in argv_forms(flag, option):
        argv = [*argv, *COMPANIONS.get(flag.name, [])]
        try:
            _, sources, launch = resolve(argv)
        except ValueError as exc:
            if flag.name not in str(exc):
                problems.append(f"{argv}: refused without naming {flag.name}: {exc}")
            continue
        accepted += 1
        rule = launch_compat.active_rules().get(name)
        if foreign and not isinstance(rule, launch_compat.Alias) and not _named(flag.name, launch) \
                and not isinstance(rule, launch_compat.MatchModel):
            problems.append(f"{argv}: accepted with no start-up line naming it")
        if isinstance(rule, launch_compat.Alias) and rule.target not in sources:
            problems.append(f"{argv}: did not set --{rule.target}")
        for level, line in launch.notes:
            if "ignored" in line and level < launch_compat.WARNING:
                problems.append(f"{argv}: ignored below warning level: {line}")
    if not accepted:
        problems.append(f"{flag.name}: no form of it is accepted")
    return problems


VLLM_FLAGS = vllm_flags()


def test_the_documents_are_read_whole():
    assert len(VLLM_FLAGS) == 147  # the usage block as the document has it
    names = {f.name for f in VLLM_FLAGS}
    assert {"--tensor-parallel-size", "--gpu-memory-utilization", "--enable-chunked-prefill",
            "--trust-remote-code", "--uvicorn-log-level", "--kv-cache-dtype"} <= names
    assert {f.short for f in VLLM_FLAGS if f.short} == {"-pp", "-tp", "-dp", "-q", "-spec-draft-tp", "-O"}
    assert {f.name for f in fastdeploy_flags()} == {"--model", "--port", "--tensor-parallel-size",
                                                      "--max-model-len", "--enable-logprob"}


def test_every_vllm_flag_is_accepted_with_a_representative_value():
    problems = [p for flag in VLLM_FLAGS for p in check_flag(flag)]
    problems += [p for flag in VLLM_FLAGS if flag.short for p in check_flag(flag, flag.short)]
    assert not problems, "\n".join(problems)


def test_every_fastdeploy_flag_is_accepted():
    problems = []
    for flag in fastdeploy_flags():
        doc = next((f for f in VLLM_FLAGS if f.name == flag.name), None)
        problems += check_flag(doc or flag)
    assert not problems, "\n".join(problems)


def test_every_foreign_flag_of_the_documents_is_in_the_table():
    """Nothing of theirs falls through to argparse's own handling unexplained: each is ours or in the table."""
    own, rules = launch_compat.own_settings(), launch_compat.active_rules()
    names = {f.name[2:].replace("-", "_") for f in [*VLLM_FLAGS, *fastdeploy_flags()]}
    assert sorted(n for n in names if n not in own and n not in rules) == []


@pytest.mark.parametrize("argv,flag", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["-tp", "8"], "--tensor-parallel-size"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    (["--device", "tpu"], "--device"),
    (["--quantization", "awq"], "--quantization"),
    (["--load-format", "dummy"], "--load-format"),
    (["--override-generation-config", '{"temprature": 0.5}'], "--override-generation-config"),
    (["--middleware", "mypkg.Auth"], "--middleware"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs"),
])
def test_values_this_server_cannot_honour_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=re.escape(flag)):
        resolve(argv)
    # the command itself: exit 2 before any model loading, the message on stderr
    assert main(["serve", "--port", str(free_port()), *argv]) == 2
    assert flag in capsys.readouterr().err


def test_the_model_positional_and_model_flag_agree_or_are_refused():
    assert resolve(["embedded"])[0].model == "embedded"
    assert resolve(["embedded", "--model", "embedded"])[0].model == "embedded"
    with pytest.raises(ValueError, match="--model"):
        resolve(["embedded", "--model", "other"])


def test_an_alias_and_our_own_flag_giving_two_values_are_refused():
    assert resolve(["--num-gpu-blocks-override", "64"])[0].num_kv_blocks == 64
    with pytest.raises(ValueError, match="--num-gpu-blocks-override"):
        resolve(["--num-gpu-blocks-override", "64", "--num-kv-blocks", "32"])


def test_speculative_config_ngram_sets_prompt_lookup_and_served_names_take_several():
    settings, _, launch = resolve(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_max": 6}', "--served-model-name", "smol", "tiny"])
    assert (settings.num_speculative_tokens, settings.prompt_lookup_max) == (3, 6)
    assert settings.served_model_name == "smol" and launch.effects["model_aliases"] == ["tiny"]


def test_the_documents_yaml_config_example_resolves_through_the_same_table(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(config_example())
    settings, sources, launch = resolve(["--config", str(config)])
    assert (settings.host, settings.port, sources["port"]) == ("127.0.0.1", 6379, "file")
    assert launch.effects["uvicorn_log_level"] == "info"
    assert any(line.startswith("--uvicorn-log-level info (in ") for _, line in launch.notes)
    # vLLM's names as keys, underscores or hyphens; refusals name the key's flag and the file
    config.write_text("tensor_parallel_size: 1\ngpu-memory-utilization: 0.8\nenable-chunked-prefill: true\n")
    _, _, launch = resolve(["--config", str(config)])
    assert any(line.startswith("--gpu-memory-utilization 0.8 (in ") and "ignored" in line for _, line in launch.notes)
    config.write_text("tensor-parallel-size: 2\n")
    with pytest.raises(ValueError, match="--tensor-parallel-size 2"):
        resolve(["--config", str(config)])


def test_the_settings_line_does_not_grow_with_foreign_flags():
    settings, sources, _ = resolve(["--gpu-memory-utilization", "0.9", "--trust-remote-code", "-tp", "1"])
    assert settings_mod.describe(settings, sources) == settings_mod.describe(*resolve([])[:2])


def test_docs_page_is_generated_from_the_table():
    page = Path(__file__).resolve().parents[1] / "docs" / "launch-flags.md"
    assert page.read_text(encoding="utf-8") == launch_compat.markdown(), \
        "regenerate: python -m spark_server.launch_compat > docs/launch-flags.md"


# --- one real start ------------------------------------------------------------------------------------------

def test_a_vllm_launch_line_starts_the_server_and_it_answers(tmp_path):
    """`vllm serve MODEL --dtype auto --api-key token-abc123` (the document's first command) as
    `spark-server serve embedded ...`, with the document's YAML config and a long launch line."""
    config = tmp_path / "config.yaml"
    config.write_text(config_example())  # host 127.0.0.1, port 6379 (the flag below wins), uvicorn-log-level
    first = shlex.split(re.search(r"```plain\nvllm serve (\S+) (.*?)\n", _vllm_text()).group(2))
    assert first == ["--dtype", "auto", "--api-key", "token-abc123"]
    port = free_port()
    ignored = ["--gpu-memory-utilization", "--trust-remote-code", "--swap-space", "--kv-cache-dtype",
               "--distributed-executor-backend", "--max-num-partial-prefills"]
    argv = ["embedded", *first, "--config", str(config), "--port", str(port),
            "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--gpu-memory-utilization", "0.9",
            "--enable-chunked-prefill", "--trust-remote-code", "--disable-log-requests", "--enable-lora",
            "--generation-config", "auto", "--kv-cache-dtype", "fp8", "--swap-space", "4", "--seed", "0",
            "--max-log-len", "100", "--served-model-name", "smol", "smol-alias", "--max-model-len", "2048",
            "--distributed-executor-backend", "mp", "--max-num-partial-prefills", "1", "--enforce-eager",
            "--disable-log-stats", "--enable-prefix-caching", "--block-size", "16", "--max-num-seqs", "4",
            "--return-tokens-as-token-ids", "--rope-theta", "100000", "--enable-logprob",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--uvicorn-log-level", "info"]
    env = dict(os.environ, SPARK_KV_CACHE_SPACE="0.25", SPARK_KV_CACHE_PREFAULT="false")
    env.pop("SPARK_LOG_LEVEL", None)
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        started = time.monotonic()
        while not lines or "serving ws://" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, "server exited early:\n" + "".join(lines)
            assert time.monotonic() - started < 120
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, verify=TLS)
        import httpx
        from openai import OpenAI

        client = OpenAI(base_url=base + "/v1", api_key="token-abc123", http_client=httpx.Client(verify=TLS))
        assert [m.id for m in client.models.list().data][:2] == ["smol", "smol-alias"]
        answer = client.chat.completions.create(model="smol-alias", max_tokens=4, temperature=0, logprobs=True,
                                                messages=[{"role": "user", "content": "Hello!"}])
        assert answer.model == "smol" and answer.choices[0].message.content
        assert answer.choices[0].logprobs.content[0].token.startswith("token_id:")  # the server-wide switch
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    log = "".join(lines) + out
    for flag in ignored:
        named = [line for line in log.splitlines() if f"{flag}" in line and "ignored" in line]
        assert len(named) == 1, (flag, named)
    assert "--tensor-parallel-size 1: this server runs the model on one device" in log
    assert "request id=" not in log  # --disable-log-requests
    settings_line = next(line for line in log.splitlines() if "settings: " in line)
    assert "gpu_memory" not in settings_line and "served_model_name='smol'(flag)" in settings_line
    assert "model='embedded'(flag)" in settings_line


def test_a_model_config_override_that_differs_from_the_model_is_refused(tmp_path):
    launch = launch_compat.Launch()
    launch.take({"rope_theta": "100000"})
    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 100000.0, "rope_scaling": None}))
    launch.check_model(str(tmp_path))
    launch.take({"rope_theta": "500000", "hf_overrides": '{"rope_scaling": null}'})
    with pytest.raises(ValueError, match="--rope-theta"):
        launch.check_model(str(tmp_path))
