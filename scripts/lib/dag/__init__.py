"""What rules/common.smk runs while Snakemake builds the DAG, before any job: the config's checks and derivations
(config.py, with the schema's defaults from schema.py, the sweeps' expansion from sweeps.py and what a recipe says from
recipe.py), the lock (lock.py), select's ranking and walk (selection.py) and each rule's code inputs (imports.py).
Stages import parts of it too (the lock, the schema, the ranking, the recipe); none of it imports a stage's own
package."""
