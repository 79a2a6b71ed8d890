"""`python3 -m serving.patches`: write the plugins' dist-info (serving/_dist) from the registry."""

from serving.patches import write_dist

for path in write_dist():
    print(f"wrote {path}")
