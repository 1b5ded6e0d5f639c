"""The hierarchical cache under the radix tree: tier 1 host memory, tier 2 disk pages (hierarchy.py, disk.py)."""

from radixgen.runtime.scheduler.tiers.hierarchy import HierarchicalCache

__all__ = ["HierarchicalCache"]
