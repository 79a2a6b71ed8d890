rule venv:
    """A stage's virtualenv from envs/<env>.txt; its pip freeze is what dependent rules depend on."""
    input:
        requirements="envs/{env}.txt",
        code=code_of("scripts/make_venv.py"),
    output:
        freeze=".venvs/{env}/pip-freeze.txt",
    params:
        repairs=lambda wildcards: VENV_REPAIRS.get(wildcards.env, []),
    resources:
        **RESOURCES["venv"],
    log:
        "logs/venv/{env}.log",
    benchmark:
        "benchmarks/venv/{env}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/make_venv.py"
