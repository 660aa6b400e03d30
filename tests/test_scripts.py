"""The demo pair's training and evaluation scripts run end to end (a few steps, not a real training)."""

import re
import subprocess
import sys
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run(*args, timeout=300):
    out = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_train_then_evaluate_a_tiny_pair(tmp_path):
    log = run(SCRIPTS / "train_demo.py", "--chat-steps", "3", "--draft-steps", "3", "--out", tmp_path)
    assert re.search(r"tokenizer: \d+ tokens, 375/375 world words are one token", log)
    assert "[chat] step 3/3" in log and "[draft] step 3/3" in log

    chat, draft = chatkit.load(str(tmp_path / "chat")), chatkit.load(str(tmp_path / "draft"))
    assert chat.config["num_hidden_layers"] > draft.config["num_hidden_layers"]
    assert chat.fingerprint["vocabulary"] == draft.fingerprint["vocabulary"]
    session = ChatSession.builder(chat).generate_params(GenerateParams(max_tokens=4)).build()
    session.respond("What is 2 + 2?")
    assert session.render().startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")

    report = run(SCRIPTS / "eval_demo.py", "--models", tmp_path, "--dialogues", "2", "--restores", "1")
    assert "exact replies per task:" in report and "recall of facts told 3+ turns ago" in report
    same = re.search(r"speculative greedy == standard greedy: (\d+)/(\d+) replies", report)
    assert same and same.group(1) == same.group(2) and int(same.group(2)) > 0
    assert re.search(r"draft acceptance \d+\.\d%", report) and "facts recalled after restore" in report
