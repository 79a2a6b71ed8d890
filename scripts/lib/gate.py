"""How a failed quality gate is worded, wherever it is reported (quality_gate, compare, select, tarball)."""


def failed_tasks(tasks: list[dict]) -> list[str]:
    """ "name score < threshold" for every task of a quality.json that did not pass."""
    return [
        f"{t['name']} {t['score'] if t['score'] is not None else 'no score'} < {t['threshold']}"
        for t in tasks
        if not t["passed"]
    ]
