"""The command line against the session's real server (--url): `complete` gives the server's own greedy text,
`chat` streams and reports the cache's share, `run` runs a program file over HTTP, `bench serve` measures it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import RADIXGEN, cli  # noqa: E402

PROGRAM = '''
import radixgen as rg


@rg.function
def capital(s, country):
    s += "The capital of " + country + " is"
    s += rg.gen("city", max_tokens=4, temperature=0)
'''


def test_complete_over_a_server_gives_its_greedy_text(server):
    prompt = "The three primary colors are"
    with server.client() as c:
        want = c.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 8,
                                               "temperature": 0}).json()["choices"][0]["text"]
    p = cli("complete", prompt, "--url", server.url, "--api-key", server.api_key, "--max-tokens", "8",
            "--temperature", "0", "--json")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["text"] == want and got["completion_tokens"] == 8 and got["prompt_tokens"] > 0
    p = cli("complete", "--url", server.url, "--api-key", server.api_key, "--max-tokens", "8", "--temperature", "0",
            input=prompt)  # the prompt from stdin
    assert p.returncode == 0 and p.stdout.strip() == want.strip()
    p = cli("complete", prompt, "--url", server.url, "--api-key", "wrong-key")
    assert p.returncode == 1 and "radixgen complete:" in p.stderr and "401" in p.stderr


def test_chat_over_a_server_in_a_terminal(server):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(RADIXGEN[0], [*RADIXGEN[1:], "chat", "--url", server.url, "--api-key", server.api_key,
                                        "--temperature", "0", "--max-tokens", "4", "--system", "Be brief."],
                          encoding="utf-8", timeout=120, env={**os.environ, "TERM": "dumb"}, dimensions=(40, 200))
    stats = r"\[(\d+) tokens, [0-9.]+ tok/s[^;]*; prompt (\d+) tokens, (\d+) from the cache\]"
    try:
        child.expect(f"chatting with {server.model}")
        child.expect(">>> ")
        child.sendline("Name a color.")
        child.expect(stats)
        assert int(child.match.group(1)) == 4
        child.expect(">>> ")
        child.sendline("Another one?")
        child.expect(stats)
        assert int(child.match.group(3)) > 0  # the first turn's prompt came from the server's radix cache
        child.expect(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_run_a_program_over_a_server(server, tmp_path):
    prog = tmp_path / "capital.py"
    prog.write_text(PROGRAM)
    p = cli("run", str(prog), "--url", server.url, "--api-key", server.api_key, "--arg", "country=France", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["error"] is None and doc["variables"]["city"].strip()


def test_bench_serve_reports_percentiles_and_goodput(server, tmp_path):
    out = tmp_path / "serve.json"
    p = cli("bench", "serve", "--url", server.url, "--api-key", server.api_key, "--num-prompts", "4",
            "--input-len", "12", "--shared-prefix-len", "30", "--output-len", "4", "--max-concurrency", "2",
            "--goodput", "ttft:600000", "e2e:600000", "--output", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "TTFT" in p.stdout and "p99" in p.stdout
    s = json.loads(out.read_text())["results"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["output_tokens"] == 16
    assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] <= s["median_e2e_ms"] * 4
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # objectives every request meets
    assert s["cache_hit_rate"] > 0  # the shared prefix
