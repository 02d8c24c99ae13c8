"""Settings precedence (flag > env > file > default) and the real `spark-server serve` process."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import pytest

from spark_server import settings as settings_mod
from tests.conftest import free_port, wait_healthy
from tests.plain_http import TLS
from tests.spark.client import answer_text, converse, spark_request


def test_precedence(tmp_path):
    cfg = tmp_path / "server.toml"
    cfg.write_text('port = 1111\nmax-num-seqs = 3\nhost = "0.0.0.0"\ndtype = "bfloat16"\n')
    env = {"SPARK_CONFIG": str(cfg), "SPARK_PORT": "2222", "SPARK_MAX_NUM_SEQS": "4"}
    s = settings_mod.resolve({"port": 3333}, env)
    assert s.port == 3333  # flag beats env
    assert s.max_num_seqs == 4  # env beats file
    assert s.host == "0.0.0.0" and s.dtype == "bfloat16"  # file beats default
    assert s.max_num_batched_tokens == 512  # default


def test_bad_values_are_named(tmp_path):
    with pytest.raises(ValueError, match="port"):
        settings_mod.resolve({}, {"SPARK_PORT": "abc"})
    cfg = tmp_path / "bad.toml"
    cfg.write_text("no_such_setting = 1\n")
    with pytest.raises(ValueError, match="no_such_setting"):
        settings_mod.resolve({"config": str(cfg)}, {})


def test_one_request_may_start_at_most_half_the_running_slots_by_default():
    """--max-seqs-per-request defaults to half of --max-num-seqs (at least 1), so another client always
    gets a slot; more than --max-num-seqs is refused at start, naming both flags."""
    assert settings_mod.resolve({}, {}).max_seqs_per_request == 32
    assert settings_mod.resolve({"max_num_seqs": 7}, {}).max_seqs_per_request == 3
    assert settings_mod.resolve({"max_num_seqs": 1}, {}).max_seqs_per_request == 1
    assert settings_mod.resolve({"max_num_seqs": 8, "max_seqs_per_request": 8}, {}).max_seqs_per_request == 8
    with pytest.raises(ValueError, match="--max-seqs-per-request 9 is more than --max-num-seqs 8"):
        settings_mod.resolve({}, {"SPARK_MAX_NUM_SEQS": "8", "SPARK_MAX_SEQS_PER_REQUEST": "9"})
    engine = settings_mod.resolve({"max_stop_strings": 5, "max_stop_chars": 50}, {}).engine_config()
    assert (engine.max_stop_strings, engine.max_stop_chars) == (5, 50)


def test_help_documents_vllm_style_flags():
    out = subprocess.run([sys.executable, "-m", "spark_server", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--host", "--port", "--model", "--dtype", "--served-model-name", "--max-num-seqs",
                 "--max-num-batched-tokens", "SPARK_PORT"):
        assert flag in out


def test_a_native_fault_leaves_the_python_stack_in_the_log():
    """A fault in native code (a kernel's SIGFPE, a SIGSEGV) ends the server at once; its log must say
    where, not end silently. Here the model load faults on purpose."""
    fault = ("import faulthandler, sys; from engine import async_engine; "
             "async_engine.AsyncEngine.from_config = staticmethod(lambda config: faulthandler._sigsegv()); "
             "from spark_server.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", fault, "serve", "--port", str(free_port())], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert "in _serve" in out.stderr  # the stack, down to the call that faulted


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of a process so far (Linux /proc)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as status:
            total += sum(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return total


def test_serve_answers_a_real_question_and_logs_for_operators():
    """What `make serve` runs: the console script on a port, answering over the WebSocket; its log has
    one settings line (where each value came from, secrets masked) and a timestamp on every line,
    uvicorn's access lines included."""
    port = free_port()
    # one OpenMP thread per core, as a server runs (`make test` gives its workers one thread each)
    env = dict(os.environ, SPARK_MAX_WAITING="9", OMP_NUM_THREADS=str(os.cpu_count() or 2))
    env.pop("SPARK_LOG_LEVEL", None)
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port), "--api-key", "sekret",
                             "--max-num-seqs", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    try:
        started = time.monotonic()
        while not lines or "serving ws://" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, "server exited early:\n" + "".join(lines)
            assert time.monotonic() - started < 120
        assert f"ws://127.0.0.1:{port}/turing/v3/gpt" in lines[-1]
        wait_healthy(f"http://127.0.0.1:{port}", verify=TLS)
        frames = asyncio.run(converse(f"ws://127.0.0.1:{port}/turing/v3/gpt?api_key=sekret",
                                      spark_request("What is the capital of France?", max_tokens=12, top_k=1)))
        assert frames[-1]["header"]["status"] == 2
        assert "Paris" in answer_text(frames)
        # The engine's OpenMP team spins between kernels instead of sleeping at each one: libgomp sleeps
        # when it counts more of its threads than cores, which a second team (the thread that built the
        # model) used to cause: ~300 context switches a token and twice the decode time on 2 cores.
        before = _voluntary_switches(proc.pid)
        frames = asyncio.run(converse(f"ws://127.0.0.1:{port}/turing/v3/gpt?api_key=sekret",
                                      spark_request("Write a long story about the sea.", max_tokens=32, top_k=1)))
        tokens = frames[-1]["payload"]["usage"]["text"]["completion_tokens"]
        per_token = (_voluntary_switches(proc.pid) - before) / tokens
        assert tokens >= 16 and per_token < 40, per_token  # ~3-5 here; ~300 with the two teams
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    lines = [line.rstrip("\n") for line in lines + out.splitlines(keepends=True) if line.strip()]
    settings = next(line for line in lines if "settings: " in line)
    assert "max_num_seqs=4(flag)" in settings and "max_waiting=9(env)" in settings
    assert "block_size" not in settings and "(default)" not in settings  # defaults only with --log-level debug
    # a normal start says nothing but its own lines: no library's warnings or notices
    stamped = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|DEBUG)|^spark-server: ")
    assert not [line for line in lines if line.strip() and not stamped.match(line)], lines
    assert "sekret" not in "\n".join(lines) and "api_key='***'(flag)" in settings
    # start-up's objects (~350,000 with the embedded model) are frozen out of the collector's full walks
    frozen = next(re.search(r"start-up heap: (\d+) objects frozen", line) for line in lines if "start-up heap" in line)
    assert int(frozen.group(1)) > 100_000
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
    access = [line for line in lines if '"GET /health' in line]
    assert access and all(stamp.match(line) for line in access), access
    logged = [line for line in lines if not line.startswith(("spark-server:", " ", "\t", "Traceback"))]
    assert all(stamp.match(line) for line in logged), [line for line in logged if not stamp.match(line)]


def test_settling_the_start_up_heap_takes_its_objects_out_of_full_collections():
    import gc

    from spark_server.cli import settle_startup_heap

    kept = [[i] for i in range(1000)]  # long-lived start-up state
    try:
        assert settle_startup_heap() >= len(kept)
        assert gc.get_freeze_count() >= len(kept) and gc.isenabled()
        oldest = {id(o) for o in gc.get_objects(2)}
        assert not any(id(x) in oldest for x in kept)  # no generation holds them: full collections skip them
    finally:
        gc.unfreeze()
