if TRAINED:

    rule train_tiny:
        """The tiny profile's brief training of download's synthesized checkpoint (model.tiny.train.steps > 0), into
        the paths later stages read; see scripts/train_tiny.py. Changed training settings rerun this, not download."""
        input:
            venv=venv("compress"),
            checkpoint=rules.download.output.checkpoint,
            manifest=rules.download.output.manifest,  # checked before the checkpoint is read
            record=rules.download.output.record,
            **tiny_training_inputs(),
            schema="schemas/download.schema.yaml",
            code=code_of("scripts/train_tiny.py"),
        output:
            checkpoint=directory(SOURCE_MODEL["checkpoint"]),
            manifest=SOURCE_MODEL["manifest"],
            record=report(SOURCE_MODEL["record"], category="Download"),
        params:
            seed=config["model"]["tiny"]["seed"],
            train=TINY_TRAIN,
            sentence=config["probe"]["sentence"],  # the latency probe's repeated sentence, among the repeated-text examples
        threads: TINY_TRAIN["threads"]  # fixes torch's thread count: the training is deterministic for a given count
        resources:
            **RESOURCES["train_tiny"],
        log:
            "logs/train_tiny/train_tiny.log",
        benchmark:
            "benchmarks/train_tiny/train_tiny.tsv"
        conda:
            "../envs/compress.yaml"
        script:
            "../scripts/train_tiny.py"
