"""`#! local-build` requirement lines (scripts/make_venv.py, scripts/lib/make_venv/local_builds.py), pure parts."""

import pytest

import make_venv
from conftest import ROOT
from lib.make_venv import local_builds
from lib.stage import StageError


def test_the_serve_venv_builds_arctic_inference_pinned():
    assert make_venv.local_build_requirements(ROOT / "envs" / "serve-cpu.txt") == ["arctic-inference==0.1.1"]
    assert set(local_builds.RECIPES) == {"arctic-inference==0.1.1"}
    with pytest.raises(StageError, match="no local-build recipe for 'arctic-inference==0.2.0'"):
        local_builds.build(ROOT, "arctic-inference==0.2.0")


def test_its_vllm_plugin_entry_point_is_removed(tmp_path):
    """arctic_inference's `vllm.general_plugins` entry point would monkeypatch vLLM in every server process."""
    info = tmp_path / "arctic_inference-0.1.1.dist-info"
    info.mkdir()
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\narctic_inference = arctic_inference.vllm.plugin:arctic_inference_plugin\n"
    )
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/entry_points.txt,sha256=x,99\n")
    removed = local_builds.drop_entry_points(tmp_path, "arctic_inference", "vllm.general_plugins")
    assert removed == ["arctic_inference = arctic_inference.vllm.plugin:arctic_inference_plugin"]
    assert not (info / "entry_points.txt").exists()
    assert (info / "RECORD").read_text() == f"{info.name}/METADATA,,\n"
    # other groups stay
    (info / "entry_points.txt").write_text("[console_scripts]\nx = a:b\n\n[vllm.general_plugins]\np = q:r\n")
    assert local_builds.drop_entry_points(tmp_path, "arctic_inference", "vllm.general_plugins") == ["p = q:r"]
    assert "[console_scripts]\nx = a:b" in (info / "entry_points.txt").read_text()


def test_the_torchvision_guard_leaves_hard_linked_copies_alone(tmp_path):
    """uv hard-links a venv's files to its cache: the repair must replace the file, never rewrite the shared one."""
    target = tmp_path / "site" / "torchvision" / "_meta_registrations.py"
    target.parent.mkdir(parents=True)
    original = (
        "import torch\nimport torchvision.extension  # noqa: F401\n\n"
        '@torch.library.register_fake("torchvision::nms")\ndef meta_nms(dets, scores, iou_threshold):\n    pass\n'
    )
    target.write_text(original)
    cached = tmp_path / "cache-copy.py"
    cached.hardlink_to(target)
    assert make_venv.guard_torchvision_fake_ops(tmp_path / "site")
    patched = target.read_text()
    assert '@_register_fake_if_ops("torchvision::nms")' in patched and "def _register_fake_if_ops" in patched
    assert cached.read_text() == original
    assert not make_venv.guard_torchvision_fake_ops(tmp_path / "site")  # once only
    target.write_text("import torch\n")
    with pytest.raises(StageError, match="unexpected layout"):
        make_venv.guard_torchvision_fake_ops(tmp_path / "site")
