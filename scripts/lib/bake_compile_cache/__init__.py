"""bake_compile_cache's own module: the compile cache packed so the same files give the same bytes (cache_tar.py)."""
