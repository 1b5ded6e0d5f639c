"""The radix tree of the prefix cache: token-id sequences -> where their KV lives.

Each node holds a KV location (`KVLocation`: its tier and its handle), never KV data: on tier 0 (the device
pool) the handle is the slot indices (one int64 per token, a tensor per node); a lower tier (1 host memory,
2 disk) names its own storage. The caller owns the allocator: slots enter the tree through `insert` and leave
it through `evict`. Along every path from the root tiers never go up (a device prefix, then lower tiers).

Contract, in the order a request uses it:
  1. `m = match_prefix(tokens, namespace)`, then `lock(m.last_node)` before using `m.slots`: an
     unlocked match may be evicted (and its slots reused) by the next `evict`.
  2. `already = insert(tokens, slots, namespace)` when the request (or a prefill chunk) is done;
     `unlock` the node locked in step 1 afterwards (for a chunk: match again and lock the new node).
  3. `evict(n)` frees least-recently-used unlocked leaves first; it may free more than asked (whole
     nodes) and less when not enough is evictable.

Tiers (the `tiers` hook, the KV cache manager's): for each node `evict` takes off the device, `tiers.demote(node)`
says None (drop it: the node and anything below it leave the tree) or gives its new lower-tier location (the node
keeps its place and key, its slots are freed). Without the hook every node is dropped. `match_prefix` returns the
device-resident prefix only, and `MatchResult.lower_len` says how much further lower tiers hold; `insert` over a
lower-tier node moves it back to the device with the caller's slots (`tiers.discard` frees the lower copy).
`evict_lower(tier, n)` is the same LRU within one lower tier; `lower_path` lists the lower-tier nodes a match would go
on through (what a load-back copies), `path_of` a node's namespace and token chain (what names its disk pages).

Namespaces ("cache salt"; with a LoRA adapter, the tuple (salt, adapter load id)): `None` is the default
namespace, stored directly under the root; every other namespace is a subtree under a child of the root
keyed by `NamespaceKey(name)`. That subtree root has an empty key (it holds no token) and is removed as
soon as its last child is evicted. Requests in different namespaces never share slots; `evict_namespace`
drops one namespace's unlocked entries (an adapter's unload).

With page_size > 1 keys are compared in whole pages: a child is looked up by the token tuple of its
first page, and matches and inserts are rounded down to whole pages.

The bookkeeping every operation keeps consistent (each tier's leaves and token counts, evictable against
protected) is the tier ledger (ledger.py), which `invariant()` checks against a walk of the tree; the read-only
views (a context's continuation, a node's path, a printout) are views.py.

The package: nodes.py (the vocabulary: Tier, KVLocation, TreeNode, MatchResult, the tier hook), ledger.py (the tier
ledger and its invariant), tree.py (RadixCache: the operations), views.py (read-only views), snapshot.py (a bounded
picture for the web console, per viewer).
"""

from radixgen.runtime.scheduler.radix import views
from radixgen.runtime.scheduler.radix.ledger import TierLedger
from radixgen.runtime.scheduler.radix.nodes import KVLocation, MatchResult, NamespaceKey, Tier, TierHook, TreeNode
from radixgen.runtime.scheduler.radix.tree import RadixCache

__all__ = ["KVLocation", "MatchResult", "NamespaceKey", "RadixCache", "Tier", "TierHook", "TierLedger", "TreeNode",
           "views"]
