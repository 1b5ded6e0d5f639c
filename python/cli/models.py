"""`radixgen models list | show | rm`: the converted-model cache ($RADIXGEN_CACHE, default ~/.cache/radixgen).

A GGUF file is converted once into a cached folder (`<name>-<hash>`: dequantized safetensors) or, with
--quantization gguf, a native one (`<name>-<hash>-native`: config and tokenizer, the weights read from the file).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from radixgen.cli.common import print_table

DESCRIPTION = "The converted-model cache: list its folders, show a model (a .gguf file, a folder or a cached " \
    "entry: architecture, parameters, quantization types and what runs natively), rm entries."
NOT_MODELS = ("kernels", "tiny")  # the C kernel builds; the tests' tiny models


def add_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="the cached folders with their sizes and sources")
    ls.add_argument("--json", action="store_true", help="print JSON")
    show = sub.add_parser("show", help="a model's architecture, size, template and tensor types")
    show.add_argument("model", nargs="?", metavar="MODEL", help="a .gguf file, a model folder or a cached entry's "
                      "name (default: the bundled model)")
    show.add_argument("--template", action="store_true", help="print the whole chat template")
    show.add_argument("--json", action="store_true", help="print JSON")
    rm = sub.add_parser("rm", help="delete cached folders (the GGUF files they came from stay)")
    rm.add_argument("names", nargs="*", metavar="NAME", help="entries as `list` names them (a unique prefix will do)")
    rm.add_argument("--all", action="store_true", help="every entry")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def cache_entries() -> list[dict[str, Any]]:
    """Every folder of the cache but the kernel builds and test models: name, kind, size, source."""
    from radixgen.runtime.loader import GGUF_SOURCE, SOURCE, cache_root

    root = cache_root()
    if not root.is_dir():
        return []
    entries = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in NOT_MODELS):
        if ".tmp" in d.name:
            kind = "incomplete"  # a conversion that stopped half-way (its process was killed)
        elif not (d / "config.json").is_file():
            kind = "other"
        else:
            kind = "native" if (d / GGUF_SOURCE).is_file() else "converted"
        source = None
        for name in (SOURCE, GGUF_SOURCE):
            try:
                source = json.loads((d / name).read_text())["path"]
                break
            except (OSError, ValueError, KeyError, TypeError):
                continue
        entries.append({"name": d.name, "kind": kind, "size": _size(d), "source": source,
                        "source_exists": source is not None and Path(source).exists(), "path": str(d)})
    return entries


def do_list(args: argparse.Namespace) -> int:
    from radixgen.runtime.loader import cache_root

    entries = cache_entries()
    if args.json:
        print(json.dumps({"cache": str(cache_root()), "entries": entries}, indent=2))
        return 0
    print(f"cache: {cache_root()}")
    if not entries:
        print("no cached models")
        return 0
    rows = [{"NAME": e["name"], "KIND": e["kind"], "SIZE": human(e["size"]),
             "SOURCE": (e["source"] or "unknown") + ("" if e["source_exists"] or not e["source"] else " (gone)")}
            for e in entries]
    print_table(rows)
    print(f"total {human(sum(e['size'] for e in entries))} in {len(entries)} entries")
    return 0


def find_entry(name: str) -> dict[str, Any] | None:
    entries = cache_entries()
    exact = [e for e in entries if e["name"] == name]
    prefixed = [e for e in entries if e["name"].startswith(name)]
    return (exact or prefixed or [None])[0] if exact or len(prefixed) == 1 else None


def do_rm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.all == bool(args.names):
        parser.error("argument NAME: give entry names or --all")
    targets = cache_entries() if args.all else []
    for name in args.names:
        entry = find_entry(name)
        if entry is None:
            parser.error(f"argument NAME: no cached entry {name!r} (or several start with it): see "
                         "`radixgen models list`")
        targets.append(entry)
    for e in targets:
        shutil.rmtree(e["path"])
        print(f"removed {e['name']} ({human(e['size'])})")
    return 0


# ---------------------------------------------------------------- show


def gguf_report(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata and its tensors' types, and what runs natively (quantization="gguf")."""
    import gguf

    from radixgen.runtime.layers.quantization.gguf import FLOAT, NATIVE
    from radixgen.runtime.models import for_gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the gguf package raises ValueError, struct.error, IndexError, ...
        raise ValueError(f"not a readable GGUF file {path}: {e}") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    experts = int(field(f"{arch}.expert_count", 0) or 0) > 0
    types: Counter = Counter()
    params: Counter = Counter()
    for t in reader.tensors:
        types[t.tensor_type.name] += 1
        params[t.tensor_type.name] += int(t.n_elements)

    def runs(name: str) -> str:
        if name in NATIVE:
            return "native blocks (--quantization gguf); else dequantized at conversion"
        if name in FLOAT:
            return "float"
        return "dequantized to float (no native kernel for this type)"

    template = field("tokenizer.chat_template")
    return {
        "file": str(path), "file_size": path.stat().st_size, "name": field("general.name"),
        "architecture": arch, "supported": for_gguf(arch, experts) is not None,
        "parameters": sum(params.values()), "context_length": field(f"{arch}.context_length"),
        "layers": field(f"{arch}.block_count"), "hidden_size": field(f"{arch}.embedding_length"),
        "heads": field(f"{arch}.attention.head_count"), "kv_heads": field(f"{arch}.attention.head_count_kv"),
        "experts": field(f"{arch}.expert_count"), "chat_template": template,
        "tensor_types": [{"type": k, "tensors": n, "parameters": params[k], "runs": runs(k)}
                         for k, n in types.most_common()],
        "all_native": all(k in NATIVE or k in FLOAT for k in types),
    }


def folder_report(path: Path) -> dict[str, Any]:
    """A model folder's config.json, its parameters (from the safetensors headers) and its chat template."""
    from radixgen.runtime.architectures import ARCHITECTURES
    from radixgen.runtime.loader import SOURCE, read_hf_config

    cfg = read_hf_config(path)
    text = cfg.get("text_config") or cfg
    n = 0
    for f in sorted(path.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(f), "numpy") as st:  # headers only; numpy: no torch import
            for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                shape = st.get_slice(key).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    template = None
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        p = path / name
        if p.is_file():
            template = p.read_text() if name.endswith(".jinja") else json.loads(p.read_text()).get("chat_template")
            if template:
                break
    source = json.loads((path / SOURCE).read_text())["path"] if (path / SOURCE).is_file() else None
    archs = cfg.get("architectures") or []
    return {
        "folder": str(path), "size": _size(path), "source": source, "architecture": archs,
        "supported": any(a in ARCHITECTURES for a in archs), "parameters": n,
        "context_length": text.get("max_position_embeddings"), "layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"), "heads": text.get("num_attention_heads"),
        "kv_heads": text.get("num_key_value_heads"), "dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
        "quantization": (cfg.get("quantization_config") or {}).get("quant_method"),
        "chat_template": template if isinstance(template, str) else None,
    }


def do_show(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from radixgen.runtime.loader import ModelLoadError, default_gguf_path

    try:
        if args.model is None:
            path = default_gguf_path()
        elif Path(args.model).expanduser().exists():
            path = Path(args.model).expanduser()
        elif (entry := find_entry(args.model)) is not None:
            path = Path(entry["path"])
        else:
            parser.error(f"argument MODEL: no such file, folder or cached entry: {args.model}")
        if path.is_file() and path.suffix != ".gguf":
            parser.error(f"argument MODEL: a model file must be a .gguf file, got {path}")
        if path.is_dir() and not (path / "config.json").is_file():
            parser.error(f"argument MODEL: the folder has no config.json: {path}")
        report = gguf_report(path) if path.is_file() else folder_report(path)
    except (ModelLoadError, OSError, ValueError) as e:
        print(f"radixgen models show: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    template = report.pop("chat_template")
    types = report.pop("tensor_types", None)
    for key, value in report.items():
        if key in ("parameters", "file_size", "size"):
            value = f"{value / 1e6:.1f} M" if key == "parameters" else human(value)
        if value not in (None, [], ""):
            print(f"{key.replace('_', ' '):15} {value}")
    if template is None:
        print(f"{'chat template':15} none")
    elif args.template:
        print(f"chat template:\n{template}")
    else:
        print(f"{'chat template':15} {len(template)} characters (--template prints it)")
    if types:
        print("tensor types:")
        print_table([{"TYPE": t["type"], "TENSORS": t["tensors"], "PARAMETERS": f"{t['parameters'] / 1e6:.1f} M",
                      "RUNS AS": t["runs"]} for t in types])
    return 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.action == "list":
        return do_list(args)
    if args.action == "show":
        return do_show(args, parser)
    return do_rm(args, parser)
