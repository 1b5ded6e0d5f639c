"""The environment a rank process starts with (engine/ranks.rank_env): the defaults the scheduler process needs
(huge pages for torch's large allocations, a short OpenMP barrier spin), each left to the caller where it sets
one."""

from __future__ import annotations

from radixgen.runtime.engine.ranks import GOMP_SPINCOUNT, rank_env


def test_defaults_and_the_callers_settings_win():
    env = rank_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "THP_MEM_ALLOC_ENABLE": "1", "GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    assert rank_env({"GOMP_SPINCOUNT": "300000"})["GOMP_SPINCOUNT"] == "300000"
    assert rank_env({"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"
    # a wait policy asked for is not overridden by a spin count of ours
    assert "GOMP_SPINCOUNT" not in rank_env({"OMP_WAIT_POLICY": "ACTIVE"})
