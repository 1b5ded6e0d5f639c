"""The command line as a user runs it: every command in a subprocess, its --help, bad arguments (exit 2 naming the
argument), `env`, `models list | show | rm` on a cache made by the loader, `run`, `bench` on a tiny model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from cli_helpers import cli
from tiny_models import tiny_model_dir

COMMANDS = ("serve", "router", "chat", "complete", "run", "bench", "models", "env")


def test_top_level_help_lists_every_command_and_an_unknown_one_exits_2():
    p = cli("--help")
    assert p.returncode == 0
    for name in COMMANDS:
        assert f"\n    {name} " in p.stdout, name
    p = cli("frobnicate")
    assert p.returncode == 2 and "invalid choice: 'frobnicate'" in p.stderr


# Every --help and every bad argument below, in one interpreter (each a main() call that exits): one import of
# torch instead of twenty. A real process's exit status is checked by the tests that follow.
_MAIN_CALLS = r"""
import contextlib, io, json, sys
from radixgen.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = main(argv)
        except SystemExit as x:
            code = x.code
    out.append({"argv": argv, "code": code, "stdout": o.getvalue(), "stderr": e.getvalue()})
print(json.dumps(out))
"""

HELPS = [[c, "--help"] for c in COMMANDS] + [["env"], ["models", "show", "--help"], ["bench", "serve", "--help"],
                                              ["bench", "latency", "--help"], ["bench", "cache", "--help"]]
BAD = [  # argv, what the message must name
    (["complete", "hi", "--temperature", "500"], "argument --temperature"),
    (["complete", "hi", "--top-p", "abc"], "argument --top-p"),
    (["complete", "hi", "--set", "nope=1"], "unknown sampling field 'nope'"),
    (["complete", "hi", "--set", "temperature"], "argument --set"),
    (["complete", "hi", "--json-schema", "[" * 5000], "argument --json-schema: json_schema: the value is nested too"),
    (["chat", "--url", "ftp://host"], "argument --url"),
    (["chat", "--url", "http://127.0.0.1:9", "--dtype", "float32"], "--dtype"),
    (["chat", "--api-key", "k"], "argument --api-key"),
    (["chat", "/no/such/model"], "argument MODEL"),
    (["run", "/no/such/program.py"], "argument PROGRAM"),
    (["bench", "serve"], "argument --url"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--goodput", "latency:5"], "argument --goodput"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--percentiles", "0,101"], "argument --percentiles"),
    (["bench", "latency", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["bench", "cache", "--workloads", "poetry"], "argument --workloads"),
    (["models", "rm"], "argument NAME"),
    (["models", "show", "/no/such/model.gguf"], "argument MODEL"),
    (["env", "--bogus"], "--bogus"),
]


def test_every_command_has_help_and_a_bad_argument_exits_2_naming_it():
    import subprocess

    argvs = HELPS + [argv for argv, _ in BAD]
    p = subprocess.run([sys.executable, "-c", _MAIN_CALLS, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for r in got[:len(HELPS)]:
        assert r["code"] == 0, r
        if r["argv"][-1] == "--help":
            assert r["stdout"].startswith("usage: radixgen " + r["argv"][0]), r
    env_text = got[HELPS.index(["env"])]["stdout"]
    assert "cpu features" in env_text and "\nkernels " in env_text and "torch " in env_text
    assert "goodput" in got[HELPS.index(["bench", "serve", "--help"])]["stdout"]
    assert "--temperature" in got[HELPS.index(["chat", "--help"])]["stdout"]  # the sampling fields' flags
    for r, (argv, named) in zip(got[len(HELPS):], BAD, strict=True):
        assert r["code"] == 2, (argv, r)
        assert named in r["stderr"], (argv, r["stderr"])


def test_a_bad_argument_exits_2_from_the_console_script():
    p = cli("models", "list", "--bogus")
    assert p.returncode == 2
    assert "unrecognized arguments: --bogus" in p.stderr and "usage: radixgen models" in p.stderr


def test_an_unreachable_server_or_a_broken_program_is_one_line_and_exit_1(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = cli("complete", "hi", "--url", f"http://127.0.0.1:{port}")
    assert p.returncode == 1 and p.stderr.startswith("radixgen complete: cannot reach") and "Traceback" not in p.stderr
    prog = tmp_path / "broken.py"
    prog.write_text("import radixgen\n\nx = 1 / 0\n")
    p = cli("run", str(prog), "--url", f"http://127.0.0.1:{port}")
    assert p.returncode == 1 and "ZeroDivisionError" in p.stderr and "line 3" in p.stderr
    assert "Traceback" not in p.stderr


def test_env_reports_cpu_features_kernels_and_versions():
    import torch

    p = cli("env", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    assert rep["cpu"]["features"] == {f: f in flags for f in rep["cpu"]["features"]}
    assert {"avx2", "avx512f", "avx512_bf16", "amx_tile"} <= set(rep["cpu"]["features"])
    assert rep["versions"]["torch"] == torch.__version__
    assert rep["kernels"]["why"] and rep["kernels"]["isa"] == (os.environ.get("RADIXGEN_CPU_ISA") or "native")
    assert rep["gpu"]["cuda_available"] == torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(tiny_model_dir("llama"))


def test_models_list_show_rm_on_a_cache_the_loader_made(tmp_path, monkeypatch, tiny):
    import shutil

    import gguf

    from radixgen.runtime import loader
    from radixgen.runtime.loader import default_gguf_path

    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path))

    def fill(path, out):  # the tiny model's files in place of a conversion (which takes a minute)
        shutil.copytree(tiny, out, dirs_exist_ok=True)
        (out / loader.GGUF_SOURCE).write_text(json.dumps({"path": str(path.resolve())}))

    # a cache entry as the loader names and records it: `<name>-<hash>-native`, its source, DONE
    native = loader._cache_folder(default_gguf_path(), None, "-native", fill)
    (tmp_path / "Half-0123.tmp999").mkdir()  # a conversion killed half-way
    (tmp_path / "kernels").mkdir()  # the kernel builds: not a model
    env = {"RADIXGEN_CACHE": str(tmp_path)}

    listed = json.loads(cli("models", "list", "--json", env=env).stdout)
    kinds = {e["name"]: (e["kind"], e["source"]) for e in listed["entries"]}
    assert kinds == {native.name: ("native", str(default_gguf_path().resolve())),
                     "Half-0123.tmp999": ("incomplete", None)}

    shown = json.loads(cli("models", "show", native.name[:12], "--json", env=env).stdout)
    assert shown["supported"] and shown["architecture"] == ["LlamaForCausalLM"] and shown["chat_template"]

    p = cli("models", "show", "--json", env=env)  # the bundled GGUF file
    assert p.returncode == 0, p.stderr
    shown = json.loads(p.stdout)
    reader = gguf.GGUFReader(str(default_gguf_path()))
    want = {}
    for t in reader.tensors:
        want[t.tensor_type.name] = want.get(t.tensor_type.name, 0) + 1
    assert {t["type"]: t["tensors"] for t in shown["tensor_types"]} == want
    assert shown["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert shown["all_native"] == all(k in ("Q4_0", "Q4_1", "Q8_0", "Q6_K", "F32", "F16", "BF16") for k in want)

    p = cli("models", "rm", native.name, env=env)
    assert p.returncode == 0 and f"removed {native.name}" in p.stdout and not native.exists()
    p = cli("models", "list", env=env)
    assert "Half-0123.tmp999  incomplete" in p.stdout and native.name not in p.stdout and "total" in p.stdout
    assert (tmp_path / "kernels").is_dir()


PROGRAM = '''
import radixgen as rg


@rg.function
def pick(s, question):
    s += "Q: " + question + "\\nA:"
    s += rg.gen("answer", max_tokens=4)
    s += " Sure? " + rg.select("sure", choices=["yes", "no"])


if __name__ == "__main__":
    raise SystemExit("the file's main block must not run")
'''


def test_run_a_program_file_over_a_batch(tiny, tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "one?"}\n\n{"question": "two?"}\n')
    p = cli("run", str(prog), "--model", tiny, "--batch", str(rows), "--json", "--temperature", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    out = [json.loads(line) for line in p.stdout.splitlines()]
    assert [o["row"] for o in out] == [0, 1]
    for o in out:
        assert o["error"] is None and o["variables"]["sure"] in ("yes", "no") and o["variables"]["answer"]
    bad = cli("run", str(prog), "--model", tiny, "--arg", "topic=x")
    assert bad.returncode == 2 and "pick takes no argument 'topic'" in bad.stderr


def test_bench_latency_throughput_and_cache(tiny, tmp_path):
    out = tmp_path / "latency.json"
    p = cli("bench", "latency", "--model", tiny, "--input-len", "16", "--output-len", "4", "--batch-sizes", "1,2",
            "--iters", "1", "--output", str(out), "--compare", "llama.cpp")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["results"]] == [1, 2] and doc["settings"]["input_len"] == 16
    assert all(r["prefill_ms"] > 0 and r["decode_tok_s"] > 0 for r in doc["results"])
    assert "decode_tok_s" in p.stdout  # the table
    assert "--compare llama.cpp" in p.stderr  # a folder is not a GGUF file: said, and skipped

    p = cli("bench", "throughput", "--model", tiny, "--num-prompts", "6", "--input-len", "12", "--output-len", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    header, row = p.stdout.splitlines()[:2]
    got = dict(zip(header.split(), row.split(), strict=True))
    assert got["requests"] == "6" and got["output_tokens"] == "18" and float(got["output_tok_s"]) > 0

    out = tmp_path / "cache.json"
    p = cli("bench", "cache", "--model", tiny, "--workloads", "multi-turn", "--requests", "4", "--output-len", "2",
            "--output", str(out))  # the cache on, then off
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["cache"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["on"]["prompt_tokens"] == rows["off"]["prompt_tokens"]
    assert rows["on"]["cached_tokens"] > 0 and rows["off"]["cached_tokens"] == 0

