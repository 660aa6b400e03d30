"""The demo pair's training and evaluation scripts run end to end (a few steps, not a real training)."""

import re
import subprocess
import sys
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams

import pytest

pytestmark = pytest.mark.scripts  # trains a tiny pair in subprocesses: about half of the suite's time

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TINY_RUN = ("--chat-steps", "3", "--draft-steps", "3", "--copy-steps", "1", "--school-steps", "1")


def run_script(*args, timeout=300):
    out = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A pair trained for 3 steps (one of each phase), and the training log."""
    folder = tmp_path_factory.mktemp("pair")
    return folder, run_script(SCRIPTS / "train_demo.py", *TINY_RUN, "--out", folder)


def test_train_then_evaluate_a_tiny_pair_with_the_calculator(trained):
    """Made-up names, held-out world, Qwen-style tool calls through the calculator, JSON forms; the
    training renderer equals the shipped template (checked inside the script), and the evaluation
    drives the tool loop and output= end to end."""
    folder, log = trained
    assert re.search(r"tokenizer: \d+ tokens; a held-out name or city is \d\.\d tokens", log)
    assert "[chat] step 3/3" in log and "[draft] step 3/3" in log and re.search(r"total \d+\.\d min", log)
    chat, draft = chatkit.load(str(folder / "chat")), chatkit.load(str(folder / "draft"))
    assert chat.config["num_hidden_layers"] > draft.config["num_hidden_layers"]
    assert chat.fingerprint["vocabulary"] == draft.fingerprint["vocabulary"]
    assert chat.context_length == 1024 and chat.tokenizer.has_tool_calling
    session = ChatSession.builder(chat).tools(chatkit.demo.tools()).generate_params(GenerateParams(max_tokens=4)).build()
    session.respond("What is 2 + 2?")
    assert session.render().startswith("<|im_start|>system\nTools: calculate<|im_end|>\n<|im_start|>user\n")
    report = run_script(SCRIPTS / "eval_demo.py", "--models", folder, "--dialogues", "2", "--restores", "1")
    assert "| held-out task | exact | count | turns past the window |" in report
    assert "| recall / untold, by held-out question |" in report and "facts recalled after restore" in report
    same = re.search(r"\| \d+\.\d% \(\d+/\d+\) \| (\d+)/(\d+) replies \|", report)  # acceptance, equal replies
    assert same and same.group(1) == same.group(2) and int(same.group(2)) > 0


def test_training_is_reproducible_from_its_seed(trained, tmp_path):
    folder, _ = trained
    run_script(SCRIPTS / "train_demo.py", *TINY_RUN, "--out", tmp_path)
    for model in ("chat", "draft"):
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (tmp_path / model / name).read_bytes() == (folder / model / name).read_bytes(), (model, name)
