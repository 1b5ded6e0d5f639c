"""`radixgen serve` flags: generated from RuntimeConfig and ServerConfig, SGLang's names accepted, bad values
refused by argparse with a message naming the option."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import typing
from typing import Any

import pytest

from radixgen.common.flags import add_dataclass_flags, values_of
from radixgen.common.options import option
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.server.launch import (
    ServerArgs,
    ServerConfig,
    add_server_args,
    parse_server_args,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixgen serve")
    add_server_args(p)
    return p


def parse(*argv: str) -> ServerArgs:
    p = parser()
    return parse_server_args(p, p.parse_args(list(argv)))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refused(capsys, *argv: str) -> str:
    """argparse's usage error (exit status 2) for this command line."""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def help_text() -> str:
    """The real console entry point's help."""
    out = subprocess.run([sys.executable, "-m", "radixgen.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_help_lists_every_field(help_text):
    listed = set(re.findall(r"(?<![\w-])--?[a-z0-9][a-z0-9-]*", help_text))  # long flags and short ones (-q)
    for cls in (RuntimeConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            names = f.metadata.get("flags") or (flag(f.name),)
            assert set(names) <= listed, f"{cls.__name__}.{f.name}: {names} not in --help"
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
    assert "--device" in listed and "--model-path" in listed
    assert "(default: 512)" in help_text  # the default comes from the dataclass field


def test_no_flags_means_the_dataclass_defaults():
    args = parse()
    assert args.engine == {} and args.server == ServerConfig() and args.api_keys == ()
    assert RuntimeConfig(**args.engine) == RuntimeConfig()


def _other_value(f: dataclasses.Field, hint: Any) -> tuple[list[str], Any]:
    """A command line giving field `f` a value other than its default, and that value."""
    choices = f.metadata.get("choices")
    name = (f.metadata.get("flags") or (flag(f.name),))[0]
    if hint is bool:
        return [name], True
    if typing.get_origin(hint) is tuple:  # a repeatable flag: one value of the element type
        item = "q_proj" if f.name == "lora_target_modules" else f"/tmp/{f.name}"
        return [name, item], (item,)
    if choices:
        value = next(c for c in choices if c != f.default)
    elif f.name == "device":
        value = "cuda:1"
    elif f.name == "dist_init_addr":
        value = "127.0.0.1:29500"
    elif hint is int:
        value = f.default + 3
    elif hint is float:
        value = f.default + 0.5
    else:
        value = f"/tmp/{f.name}"
    return [name, str(value)], value


# fields valid only beside others (a group over several nodes): the flags that make them so
COMPANIONS = {"nnodes": {"tp_size": 4, "dist_init_addr": "127.0.0.1:29500"},
              "node_rank": {"nnodes": 4, "tp_size": 4, "dist_init_addr": "127.0.0.1:29500"},
              "ep_size": {"tp_size": 4},
              "kv_cache_dir": {"page_size": 16}}  # the disk tier's files are whole pages


def test_every_runtime_field_reaches_the_config():
    hints = typing.get_type_hints(RuntimeConfig)
    for f in dataclasses.fields(RuntimeConfig):
        hint = hints[f.name]
        if typing.get_origin(hint) is not tuple:  # X | None: X
            hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        argv, value = _other_value(f, hint)
        extra = COMPANIONS.get(f.name, {})
        for name, v in extra.items():
            argv += [flag(name), str(v)]
        args = parse(*argv)
        assert args.engine == {f.name: value, **extra}, argv
        assert getattr(RuntimeConfig(**args.engine), f.name) == value


def test_sglang_command_line():
    args = parse(
        "--model-path", "/models/m", "--host", "0.0.0.0", "--port", "8000", "--chunked-prefill-size", "256",
        "--schedule-policy", "fcfs", "--disable-radix-cache", "--context-length", "4096",
        "--max-running-requests", "16", "--max-total-tokens", "20000", "--api-key", "sk-1",
        "--served-model-name", "m", "--device", "cuda", "--dtype", "bfloat16", "--log-level", "warning",
        "--page-size", "4", "--cuda-graph-max-bs", "32", "--disable-cuda-graph", "--quantization", "awq",
    )
    cfg = RuntimeConfig(**args.engine)
    assert (cfg.model, cfg.device, cfg.dtype, cfg.chunked_prefill_size) == ("/models/m", "cuda", "bfloat16", 256)
    assert (cfg.schedule_policy, cfg.disable_radix_cache, cfg.context_length) == ("fcfs", True, 4096)
    assert (cfg.max_running_requests, cfg.max_total_tokens, cfg.page_size) == (16, 20000, 4)
    assert (cfg.cuda_graph_max_bs, cfg.disable_cuda_graph, cfg.quantization) == (32, True, "awq")
    s = args.server
    assert (s.host, s.port, s.served_model_name, s.log_level) == ("0.0.0.0", 8000, "m", "warning")
    assert args.api_keys == ("sk-1",)
    assert parse("--model", "/models/m").engine == {"model": "/models/m"}  # our own name for it


def test_sglang_lora_command_line():
    """SGLang's LoRA flags: several adapters after one --lora-paths (NAME=PATH, or a bare path named after its
    folder), --max-loras-per-batch for --max-loras; the flag repeated adds more."""
    args = parse("--enable-lora", "--lora-paths", "sql=/ad/sql", "/ad/chat", "--max-loras-per-batch", "4",
                 "--max-lora-rank", "32", "--lora-target-modules", "q_proj", "v_proj", "--lora-paths", "x=/ad/x")
    cfg = RuntimeConfig(**args.engine)
    assert cfg.lora_paths == ("sql=/ad/sql", "/ad/chat", "x=/ad/x") and cfg.lora_enabled
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.lora_target_modules) == (4, 32, ("q_proj", "v_proj"))
    assert RuntimeConfig(lora_paths=("/ad/chat/",)).lora_enabled and not RuntimeConfig().lora_enabled
    from radixgen.runtime.lora.adapter import parse_lora_paths

    assert parse_lora_paths(cfg.lora_paths) == [("sql", "/ad/sql"), ("chat", "/ad/chat"), ("x", "/ad/x")]


@pytest.mark.parametrize("argv, message", [
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--lora-paths", "=/ad/x"], "LoRA adapter name ''"),
    (["--lora-paths", "a=/x", "a=/y"], "two adapters named 'a'"),
    (["--lora-paths", "a="], "'a=' has no path"),
    (["--max-loras", "0"], "max_loras must be >= 1"),
    (["--lora-paths", "a=/x", "--tp-size", "2"], "not supported with tensor or pipeline parallelism (tp_size=2"),
    (["--lora-target-modules", "lm_head"], "unknown module(s) ['lm_head']"),
    (["--max-kv-memory-gb", "lots"], "argument --max-kv-memory-gb: invalid float value"),
    (["--schedule-policy", "random"], "argument --schedule-policy: invalid choice: 'random'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--quantization", "int3"], "argument --quantization/-q: invalid choice: 'int3'"),
    (["--device", "tpu"], "device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--page-size", "0"], "page_size must be >= 1, got 0"),
    (["--max-total-tokens", "-5"], "max_total_tokens must be >= 0"),
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--max-request-bytes", "0"], "max_request_bytes must be >= 1"),
    (["--api-key", ""], "api_keys: a key must be non-empty"),
    (["--api-key-file", "/nonexistent/keys.txt"], "api_key_file: cannot read '/nonexistent/keys.txt'"),
    (["--disable-radix-cache", "yes"], "unrecognized arguments: yes"),
    (["--deterministic", "--tp-size", "2", "--ep-size", "2"], "deterministic mode does not run with ep_size=2"),
    (["--deterministic", "--device", "cuda"], "deterministic mode does not run with device=cuda"),
    (["--extra", "{}"], "unrecognized arguments: --extra"),
])
def test_bad_values_are_usage_errors(capsys, argv, message):
    err = refused(capsys, *argv)
    assert "usage: radixgen serve" in err and message in err, err


def test_api_keys_from_flags_and_file(tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-b\n\n  sk-c  \nsk-a\n")
    ns = parser().parse_args(["--api-key", "sk-a", "--api-key-file", str(keys), "--api-key", "sk-d"])
    server = ServerConfig(**values_of(ServerConfig, ns))
    assert server.api_keys == ("sk-a", "sk-d") and server.all_api_keys() == ("sk-a", "sk-d", "sk-b", "sk-c")
    public = ServerArgs(server, {}, server.all_api_keys()).public()
    assert public["api_key"] == "<set>" and public["num_api_keys"] == 4
    assert "sk-" not in repr(public)
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    assert "holds no key" in refused(capsys, "--api-key-file", str(tmp_path / "empty.txt"))


def test_generated_flags_of_any_config():
    @dataclasses.dataclass(frozen=True)
    class Demo:
        warm: bool = option(True, "keep it warm")
        names: tuple[str, ...] = option((), "a name", flags=("--name",))
        limit: int | None = option(None, "a limit")
        ratio: float = option(0.5, "a ratio")

    p = argparse.ArgumentParser()
    add_dataclass_flags(p, Demo)
    assert values_of(Demo, p.parse_args([])) == {}
    given = values_of(Demo, p.parse_args(["--no-warm", "--name", "a", "--name", "b", "--limit", "3"]))
    assert given == {"warm": False, "names": ("a", "b"), "limit": 3}
    assert Demo(**given) == Demo(False, ("a", "b"), 3, 0.5)
    assert values_of(Demo, p.parse_args(["--warm"])) == {"warm": True}

    @dataclasses.dataclass
    class Unflaggable:
        table: dict = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="Unflaggable.table: no command-line form"):
        add_dataclass_flags(argparse.ArgumentParser(), Unflaggable)


def test_engine_options_are_the_config_fields():
    with pytest.raises(ValueError, match=r"unknown Engine option\(s\) \['extra'\]"):
        RuntimeConfig.from_kwargs(extra={})
    cfg = RuntimeConfig.from_kwargs("/models/m", device="cuda:0", schedule_policy="fcfs")
    assert (cfg.model, cfg.device, cfg.schedule_policy) == ("/models/m", "cuda:0", "fcfs")
