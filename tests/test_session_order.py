"""conftest's plan for a session: what the background build makes, and the order the e2e modules run in so that each
starts once the build has made what it needs."""

from types import SimpleNamespace

import pytest

import conftest


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return object() if name == "e2e" and self.e2e else None


def item(fixtures=(), e2e=True, **module):
    return Item(fixturenames=list(fixtures), e2e=e2e, module=SimpleNamespace(**module))


VARIANT = conftest._tiny_config()["variant"]
IMAGE = f"results/{VARIANT}/build_image/image.json"


def test_a_quick_session_builds_nothing_in_the_background():
    quick = item(["tiny_quantized"], e2e=False, NEEDS=["tiny_quantized"])  # a quick test of a module with NEEDS
    assert conftest.background_targets([quick, item(["tmp_path"]), item(["docker_daemon"])]) == []


def test_the_venvs_alone_when_no_test_needs_the_dag():
    assert conftest.background_targets([item(["tiny_checkpoint"])]) == conftest.VENV_TARGETS


def test_a_dag_test_adds_the_default_variant_up_to_its_image_and_modules_add_their_own():
    slurm = item(["slurm_cluster", "tiny_checkpoint"], BACKGROUND_TARGETS=["a/b.json", IMAGE])
    targets = conftest.background_targets([item(["tiny_run"]), slurm])
    assert targets == [*conftest.VENV_TARGETS, IMAGE, "a/b.json"]  # each once


@pytest.mark.parametrize(
    "fixtures, needs, rank",
    [
        ((), (), 0),
        (("tiny_venvs",), (), 0),
        (("tiny_venvs", "tiny_checkpoint"), (), 1),
        (("host_server",), ("tiny_quantized",), 2),  # through request.getfixturevalue: the module's NEEDS
        (("tiny_base_image", "tiny_checkpoint"), (), 3),
        (("slurm_cluster", "tiny_checkpoint"), (), 4),
        (("tiny_run", "tiny_base_image"), (), 5),
    ],
)
def test_a_module_ranks_by_the_last_thing_it_needs(fixtures, needs, rank):
    assert conftest.module_rank(item(fixtures, NEEDS=needs)) == rank
