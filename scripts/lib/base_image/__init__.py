"""base_image's own module: stand-ins for the CUDA libraries a CPU image links but never calls (elf_stubs.py)."""
