"""The command line's flags: the parser, one rule per flag said in ``--help``, and checks that name flags.

The flags that pick and run a model (``add_model_flags``, ``add_sampling_flags``) and what their values
mean (``load_model``, ``load_draft``) are declared once here, for ``chatkit chat`` and ``chatkit serve``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ChatKitError, ModelLoadError

if TYPE_CHECKING:
    from ..cache.prompt import PromptCache
    from ..model.adapters import Adapter
    from ..model.loaded import LoadedModel
    from ..session.context import ContextPolicy

COMMANDS = """commands:
  /save FILE     save the conversation and its cache
  /load FILE     continue a saved conversation
  /undo          drop the last exchange
  /retry         answer the last message again
  /clear         forget the conversation
  /system TEXT   set the system prompt (/system alone removes it)
  /image PATH    attach an image to your next message (a vision-language model)
  /stats         what the last turn cost and what the cache holds
  /tools         the tools the model may call (Python functions, MCP servers')
  /context       the context window: tokens in use, what was dropped from it, the summary
  /help          this help
  /quit          leave (or Ctrl-D on an empty line); Ctrl-C stops a reply and keeps it as far as it got"""

KEYS = """keys (in a terminal): arrows and Emacs keys edit the line, Up/Down walk the history, Ctrl-R searches it,
Esc then Enter starts a new line inside a message (pasted text keeps its lines). The history is kept in
{history} (set CHATKIT_HISTORY_FILE to move it, or to an empty value to keep none)."""

CHAT_DESCRIPTION = """A streaming chat in the terminal. Without --model it chats with chatkit's bundled demo model, a
tiny model of a small world (facts you tell it, arithmetic through its calculate tool, small talk): see
the README ("What the demo model understands"). Replies are greedy unless --temp is given; the KV
cache is reused from turn to turn."""

CHAT_MAX_TOKENS = 256  # a chat reply's length without --max-tokens (or a resumed file's)
MIN_KV_SIZE = 8  # CacheOptions' lower bound: mlx-lm's rotating cache keeps 4 tokens and needs room past them
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
CONTEXT_POLICIES = ("error", "rolling", "summarize")
DEFAULT_CONTEXT_POLICY = "rolling"  # a chat should go on


class UsageError(ChatKitError):
    """A flag's value or a combination of flags cannot work; the message names the flags."""


def version() -> str:
    """``chatkit X (mlx Y, mlx-lm Z)``: what ``--version`` prints."""
    from .._version import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"chatkit {__version__} (mlx {installed('mlx')}, mlx-lm {installed('mlx-lm')})"


def _int_at_least(low: int, rule: str, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; {rule}") from None
        if value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is too {'small' if value < low else 'large'}; {rule}")
        return value

    return parse


def _num_draft(text: str) -> int | str:
    return "auto" if text == "auto" else _int_at_least(1, "use 'auto' or 1 to 64", high=64)(text)


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; use 0 (greedy) or more") from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is out of range; use 0 (greedy) or a larger finite number")
    return value


def _adapter_scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; use e.g. 0.5 or 1") from None
    if not abs(value) < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; use e.g. 0.5 or 1")
    return value


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--draft`` and ``--num-draft``: the same for every command that runs a model."""
    p.add_argument("--model", metavar="ID|PATH|demo",
                   help="a Hugging Face repo id, a local model folder, a GGUF file, 'smollm2', 'ollama:NAME', "
                        "'lmstudio:PUBLISHER/MODEL', or 'demo' (default: demo); `chatkit models` lists what is found")
    p.add_argument("--draft", metavar="ID|PATH|demo|prompt_lookup",
                   help="speculative decoding: a smaller model sharing the tokenizer, or 'prompt_lookup' (drafts "
                        "from the conversation itself, no model) (default: none). "
                        "A draft pays off only when it is much cheaper than the model and agrees with it: the "
                        "demo pair's draft costs nearly as much as the model on a CPU, so with --num-draft "
                        "auto it decodes plainly and probes now and then (about 1.0x standard decoding, "
                        "measured idle): leave --draft out with the demo")
    p.add_argument("--num-draft", type=_num_draft, default="auto", metavar="auto|N",
                   help="tokens drafted per step with --draft: 'auto' tunes it from the acceptance and the step "
                        "times measured so far, down to not drafting while it does not pay; or 1 to 64 "
                        "(default: %(default)s)")


def add_sampling_flags(p: argparse.ArgumentParser, *, max_tokens: int, otherwise: str) -> None:
    """``--temp`` and ``--max-tokens`` (``None`` when not given): ``max_tokens`` is the reply length
    without the flag, ``otherwise`` what else may set them (both said in ``--help``)."""
    p.add_argument("--temp", type=_temperature, metavar="T",
                   help=f"sampling temperature, 0 or more (default: 0, greedy; {otherwise})")
    p.add_argument("--max-tokens", type=_int_at_least(1, "use 1 or more"), metavar="N",
                   help=f"longest reply in tokens (default: {max_tokens}, {otherwise})")


def add_context_flag(p: argparse.ArgumentParser, *, otherwise: str = "") -> None:
    """``--context-policy`` (``None`` when not given: ``DEFAULT_CONTEXT_POLICY``, or ``otherwise``)."""
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES, metavar="error|rolling|summarize",
                   help="when the conversation outgrows the model's context window: 'rolling' takes the oldest "
                        "exchanges out of what the model sees (the transcript keeps them), 'summarize' also folds "
                        "them into a summary the model writes, 'error' refuses the message "
                        f"(default: {DEFAULT_CONTEXT_POLICY}{otherwise})")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """``2GB`` (10^9), ``512MiB`` (2^20), ``0`` or a plain number of bytes, for the size flags."""
    number = text.strip().lower().rstrip("bkmgti")
    unit = text.strip().lower()[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 2GB, 512MiB or 0") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of 0 or more bytes")
    return int(value)


def add_prompt_cache_flags(p: argparse.ArgumentParser, *, folder: str) -> None:
    """``--prompt-cache DIR|off``, ``--prompt-cache-ram SIZE``, ``--prompt-cache-disk SIZE``; ``folder``
    says in ``--help`` what the folder is without the flag."""
    p.add_argument("--prompt-cache", metavar="DIR|off",
                   help="KV blocks of prompts shared by every conversation are also kept in DIR, reused after a "
                        f"restart; 'off' turns the prompt cache off (default: {folder}; see docs/caching.md)")
    p.add_argument("--prompt-cache-ram", type=byte_size, metavar="SIZE",
                   help="memory for the prompt cache's blocks, e.g. 2GB or 512MiB; 0: none in RAM "
                        "(default: an eighth of the machine's memory, at most 2 GiB)")
    p.add_argument("--prompt-cache-disk", type=byte_size, metavar="SIZE",
                   help="disk space for the prompt cache's folder, e.g. 10GB; 0: no folder (default: 10 GiB)")


def prompt_cache(args: argparse.Namespace, folder: Path | None) -> PromptCache | None:
    """The ``chatkit.PromptCache`` the flags describe (``folder``: the default folder, or none); ``None``
    for ``--prompt-cache off``. ``UsageError`` when the folder cannot be used."""
    from ..cache.prompt import DEFAULT_DISK_BYTES, PromptCache

    if args.prompt_cache == "off":
        return None
    where = Path(args.prompt_cache).expanduser() if args.prompt_cache else folder
    disk = DEFAULT_DISK_BYTES if args.prompt_cache_disk is None else args.prompt_cache_disk
    try:
        return PromptCache(where if disk else None, ram_bytes=args.prompt_cache_ram, disk_bytes=disk)
    except ChatKitError as exc:
        raise UsageError(f"--prompt-cache: {exc}") from exc


def context_policy(name: str | None) -> ContextPolicy:
    """The ``chatkit.ContextPolicy`` that ``--context-policy NAME`` names (``None``: the default)."""
    from ..session.context import ContextPolicy

    made = {"error": ContextPolicy.error, "rolling": ContextPolicy.rolling, "summarize": ContextPolicy.summarize}
    return made[name or DEFAULT_CONTEXT_POLICY]()


def parser() -> argparse.ArgumentParser:
    """``chatkit [--version] {chat,serve,inspect,models}``; ``chat`` is the default command (``chatkit serve``
    is listed here but has its own parser: serve.py)."""
    p = argparse.ArgumentParser(
        prog="chatkit",
        description="Chat with a local model through chatkit (mlx-lm). `chatkit` alone is `chatkit chat`.",
    )
    p.add_argument("--version", action="version", version=version())
    commands = p.add_subparsers(dest="command", metavar="{chat,serve,inspect,models}")
    _add_chat(commands)
    commands.add_parser(  # listed here for --help; `chatkit serve ...` is parsed by serve.py's own parser
        "serve", help="serve a model over OpenAI's chat completions and responses APIs (chatkit serve --help)",
        add_help=False)
    insp = commands.add_parser(
        "inspect",
        help="show what a saved conversation holds",
        description="Show a file saved with /save or --save (or a raw mlx-lm prompt cache): its size, "
                    "tokens, model fingerprint, settings and messages. Reads the header only.",
    )
    insp.add_argument("file")
    insp.add_argument("--all", action="store_true", help="show every message (default: the last 6)")
    insp.add_argument("--model", metavar="ID|PATH|demo",
                      help="also check whether the file fits this model (loads it)")
    commands.add_parser("models", help="list the models chatkit finds (bundled, smollm2, Ollama, LM Studio)")
    return p


def _add_chat(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``chat`` command and its flags."""
    chat = commands.add_parser(
        "chat",
        help="a streaming chat in the terminal (the default)",
        description=CHAT_DESCRIPTION,
        epilog=COMMANDS + "\n\n" + KEYS.format(history=_history_for_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flags(chat)
    chat.add_argument("--distributed", choices=("tensor", "pipeline", "auto"),
                      help="shard the model over the ranks mlx.launch started (docs/distributed.md)")
    chat.add_argument("--distributed-timeout", type=float, default=120.0, metavar="SECONDS",
                      help="how long a rank waits for the others in one step before stopping (default: %(default)s)")
    chat.add_argument("--tools", action="append", metavar="MODULE[:FUNCTION]",
                      help="a Python function the model may call: MODULE:FUNCTION, or MODULE alone for every "
                           "public function the module defines (those in its __all__ if it has one); modules in "
                           "the current folder are found. Repeat for more; with the demo model they join its "
                           "calculate tool. A tool's schema comes from its signature, type hints and docstring "
                           "(an Args: section)")
    chat.add_argument("--mcp", action="append", metavar="'COMMAND ARGS' | URL",
                      help="an MCP server whose tools the model may call: a command line starting one over stdio "
                           "(quoted, e.g. --mcp 'uvx mcp-server-time'), or a streamable HTTP URL "
                           "(http://host:port/mcp). Repeat for more; /tools lists every tool")
    chat.add_argument("--adapter", metavar="PATH",
                      help="an mlx-lm LoRA/DoRA adapter folder (what mlx_lm.lora writes: adapter_config.json and "
                           "adapters.safetensors) applied to the model for this chat (default: none)")
    chat.add_argument("--adapter-scale", type=_adapter_scale, metavar="X",
                      help="with --adapter: how strongly it applies, times the adapter's own scale (default: 1)")
    chat.add_argument("--no-adapter", action="store_true",
                      help="with --model smollm2: the base model alone (without --adapter, chatkit's tools adapter is applied "
                           "and the demo's calculate tool given: see docs/adapters.md)")
    chat.add_argument("--hide-thinking", action="store_true", help="do not show the model's reasoning")
    chat.add_argument("--system", metavar="TEXT", help="the system prompt (default: none, or the saved one with --resume)")
    chat.add_argument("--resume", metavar="FILE",
                      help="continue a conversation saved with /save or --save; --system, --temp, --max-tokens, "
                           "--max-kv-size and --kv-bits given with it override the file's settings")
    chat.add_argument("--save", metavar="FILE",
                      help="save the conversation to FILE after every turn and on exit (its folder must exist)")
    add_sampling_flags(chat, max_tokens=CHAT_MAX_TOKENS, otherwise="or the saved one with --resume")
    add_prompt_cache_flags(chat, folder="prompt-cache in the user cache folder, " + str(prompt_cache_folder()))
    add_context_flag(chat, otherwise=", or the saved one with --resume")
    chat.add_argument("--max-kv-size", type=_int_at_least(MIN_KV_SIZE, f"use {MIN_KV_SIZE} or more, or leave the flag out"),
                      metavar="N",
                      help=f"keep at most the last N tokens in the KV cache (a rotating cache), N >= {MIN_KV_SIZE} "
                           "(default: no limit). The model then forgets what scrolled out of it. Cannot be combined "
                           "with --kv-bits or with a --draft model (--draft prompt_lookup works)")
    chat.add_argument("--max-kv-bytes", type=byte_size, metavar="SIZE",
                      help="a memory budget for the conversation's KV cache (e.g. 2GB): the window becomes the "
                           "tokens that fit, and the context policy works at that window")
    chat.add_argument("--kv-bits", type=int, choices=KV_BITS, metavar="B",
                      help="quantize the KV cache to B bits: one of 2, 3, 4, 5, 6, 8 (default: not quantized)")
    chat.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, metavar="N",
                      help="values per quantization group with --kv-bits: 32, 64 or 128 dividing the model's "
                           "head size (default: 64, or 32 when 64 does not divide the head size)")


def prompt_cache_folder() -> Path:
    """``chatkit chat``'s prompt-cache folder: ``$CHATKIT_PROMPT_CACHE_DIR``, else ``prompt-cache`` in the
    user cache folder."""
    from .._cachedir import user_cache_dir

    if os.environ.get("CHATKIT_PROMPT_CACHE_DIR"):
        return Path(os.environ["CHATKIT_PROMPT_CACHE_DIR"]).expanduser()
    return user_cache_dir() / "prompt-cache"


def _history_for_help() -> str:
    from .terminal import history_path

    path = history_path()
    return str(path) if path is not None else "no file (CHATKIT_HISTORY_FILE is empty)"


def check_combination(args: argparse.Namespace) -> None:
    """Flag combinations that cannot work, refused before anything loads."""
    if args.draft and args.draft != "prompt_lookup" and args.max_kv_size is not None:
        raise UsageError(
            "--draft with a model cannot be combined with --max-kv-size: the draft's own cache could not follow "
            "the rotating window. Use --draft prompt_lookup, or drop one of them."
        )
    if args.kv_bits is not None and args.max_kv_size is not None:
        raise UsageError("--kv-bits cannot be combined with --max-kv-size (mlx-lm cannot quantize a rotating cache): drop one.")
    if args.kv_group_size is not None and args.kv_bits is None:
        raise UsageError("--kv-group-size only applies with --kv-bits: add --kv-bits B or drop it.")
    if args.adapter_scale is not None and args.adapter is None:
        raise UsageError("--adapter-scale only applies with --adapter: add --adapter PATH or drop it.")
    if getattr(args, "no_adapter", False) and args.adapter is not None:
        raise UsageError("--no-adapter and --adapter contradict each other: keep one.")
    if getattr(args, "no_adapter", False) and args.model != "smollm2":
        raise UsageError("--no-adapter only applies with --model smollm2 (no other model gets an adapter by default): drop it.")
    if args.adapter is not None and args.distributed is not None:
        raise UsageError("--adapter cannot be combined with --distributed (adapters switch on one process's "
                         "layers): fuse the adapter into the model with mlx_lm.fuse and load that instead.")


def check_save_path(path: str, flag: str = "--save") -> Path:
    """A path a conversation can be saved to: its folder exists and is writable, and it is not a folder."""
    target = Path(os.path.expanduser(path))
    where = f"{flag} {path}"
    if path.endswith(("/", os.sep)) or target.is_dir():
        raise UsageError(f"{where}: that is a folder; give a file name, e.g. {os.path.join(path, 'chat.safetensors')}.")
    folder = target.parent
    if not folder.exists():
        raise UsageError(f"{where}: the folder {str(folder)!r} does not exist; create it (mkdir -p {folder}) or pick another path.")
    if not folder.is_dir():
        raise UsageError(f"{where}: {str(folder)!r} is a file, not a folder; pick another path.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: cannot write in {str(folder)!r}; pick a folder you can write to.")
    if target.exists() and not target.is_file():
        raise UsageError(f"{where}: {str(target)!r} exists and is not a regular file; pick another name.")
    return target


def kv_group_size(args: argparse.Namespace, head_dim: int | None) -> int:
    """``--kv-group-size``, or the default: 64 when it divides the head size, else the largest that does."""
    fits = [g for g in (64, 128, 32) if head_dim is None or head_dim % g == 0]
    if args.kv_group_size is not None:
        if head_dim is not None and args.kv_group_size not in fits:
            hint = f"use --kv-group-size {max(fits)}" if fits else "this model's KV cache cannot be quantized: drop --kv-bits"
            raise UsageError(
                f"--kv-group-size {args.kv_group_size} does not divide this model's head size ({head_dim}): {hint}."
            )
        return args.kv_group_size
    if not fits:
        raise UsageError(f"--kv-bits: this model's head size ({head_dim}) is not a multiple of 32, so its KV cache "
                         "cannot be quantized; drop --kv-bits.")
    return fits[0]


def explicit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The generation flags the user gave, by flag name (the ones that override a resumed file's)."""
    given = {"--system": args.system, "--temp": args.temp, "--max-tokens": args.max_tokens,
             "--context-policy": args.context_policy}
    return {flag: value for flag, value in given.items() if value is not None}


@contextmanager
def progress_lines(err: Any = None) -> Iterator[None]:
    """While a model loads, what ``chatkit.model`` logs at INFO (a first fetch of SmolLM2, a first GGUF
    conversion) as lines on stderr (``err``): those take a while, the user should know why."""
    logger = logging.getLogger("chatkit.model")
    handler = logging.StreamHandler(err if err is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # shown once, here, whatever the root logger does
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def load_model(name: str | None, **options: Any) -> LoadedModel:
    """The model ``--model`` names (the demo when it is not given); ``options`` go to ``chatkit.load``."""
    from ..model.load import load

    with progress_lines():
        return load(name or "demo", **options)


def read_adapter(path: str | None) -> Adapter | None:
    """The adapter folder ``--adapter`` names, read and checked before the model loads (``None`` without it);
    ``ModelLoadError`` naming the flag."""
    if path is None:
        return None
    from ..model.adapters import load_adapter

    try:
        return load_adapter(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"--adapter {path}: {exc}") from None


def fit_adapter(adapter: Adapter | None, lm: LoadedModel) -> None:
    """``ModelLoadError`` naming ``--adapter`` when the adapter does not fit the loaded model."""
    from ..model.adapters import check_adapter

    if adapter is not None:
        try:
            check_adapter(adapter, lm)
        except ModelLoadError as exc:
            raise ModelLoadError(f"--adapter {adapter.path}: {exc}") from None


def adapter_key(adapter: Adapter | None, args: argparse.Namespace) -> str | None:
    """What a saved cache records of the adapter ``--adapter`` and ``--adapter-scale`` give (``None``: none)."""
    from ..model.switchable import ActiveAdapter

    scale = 1.0 if args.adapter_scale is None else args.adapter_scale
    return None if adapter is None else ActiveAdapter(adapter, float(scale)).key


def load_draft(name: str | None) -> LoadedModel | str | None:
    """What ``--draft`` names: a draft model loaded ('demo': the demo's own draft), 'prompt_lookup' or nothing."""
    if not name or name == "prompt_lookup":
        return name
    from ..model.load import load

    with progress_lines():
        return load("demo-draft" if name == "demo" else name)


__all__ = [
    "COMMANDS", "CONTEXT_POLICIES", "UsageError", "adapter_key", "add_context_flag", "add_model_flags",
    "add_prompt_cache_flags", "add_sampling_flags", "byte_size", "check_combination", "check_save_path",
    "context_policy", "fit_adapter", "kv_group_size", "load_draft", "load_model", "parser", "progress_lines",
    "prompt_cache", "prompt_cache_folder", "read_adapter", "version",
]
