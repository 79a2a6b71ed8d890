"""A plugin switch that changes what torch.compile traces must change vLLM's compile-cache key too: otherwise a cache
baked with the switch in one position is loaded by a server with it in the other, and the graphs of the first run."""


def join_compile_key(envs_module, name: str, value: str) -> None:
    """Make `name`=`value` one of the environment values vLLM hashes into its torch.compile cache key
    (vllm.envs.compile_factors hashes every entry of environment_variables)."""
    envs_module.environment_variables.setdefault(name, lambda: value)
