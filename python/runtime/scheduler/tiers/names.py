"""What names the disk tier's pages: the fingerprint of everything that makes two servers' KV interchangeable, and
the namespace a page's name hashes (LoRA adapters by the digest of their weights)."""

from __future__ import annotations

import hashlib
import json

FORMAT_VERSION = 1  # of the page files' contents; part of the fingerprint

STAY = object()  # disk_namespace's answer for a namespace whose pages stay in tiers 0 and 1


def disk_namespace(namespace, adapter_digest=None):
    """The namespace a page file's name hashes, or STAY. The default one and cache salts (API-key scopes) are
    themselves; a LoRA adapter's (salt, load id) becomes (salt, the digest of the adapter's weights): a load id
    is valid in one process only, while the digest names the same weights in every process and replica, and
    another adapter or the base model never meets its pages. STAY: an adapter whose digest is unknown."""
    if namespace is None or isinstance(namespace, str):
        return namespace
    digest = adapter_digest(namespace[1]) if adapter_digest is not None and len(namespace) == 2 else None
    return STAY if digest is None else ("lora", namespace[0], digest)


def fingerprint(runner, page_size: int) -> str:
    """What makes two servers' pages interchangeable: the model (config, weight files by name and size, the dummy
    weights' seed), the weight quantization, the dtype, the pool's and the host tier's formats, the page size, the
    rank's shard. Anything else differing gives another fingerprint, so a page is never read by a server that would
    have computed other KV."""
    cfg, path = runner.runtime_config, runner.model_path
    if path.is_dir():
        files = sorted((f.name, f.stat().st_size) for f in path.iterdir()
                       if f.suffix in (".safetensors", ".gguf", ".bin", ".pt"))
    else:
        files = [(path.name, path.stat().st_size)]
    par = runner.parallel
    parts = {"version": FORMAT_VERSION, "config": runner.hf_config, "files": files, "load_format": cfg.load_format,
             "seed": cfg.seed if cfg.load_format == "dummy" else None, "quantization": str(runner.quantization),
             "dtype": str(runner.dtype), "pool": str(runner.kv_pool.format), "host": str(runner.host_pool.format),
             "page_size": page_size, "tp": [par.tp_rank, par.tp_size], "pp": [par.pp_rank, par.pp_size]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
