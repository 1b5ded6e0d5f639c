"""The frontend language: `@function` programs, their IR, interpreter and backends."""

from radixgen.lang.api import (
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixgen.lang.backend_base import BaseBackend
from radixgen.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixgen.lang.global_config import GlobalConfig, global_config
from radixgen.lang.interpreter import ProgramError
from radixgen.lang.program import Function
from radixgen.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "BaseBackend",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Function",
    "GlobalConfig",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
